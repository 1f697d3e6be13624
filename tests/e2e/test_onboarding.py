"""A hospital onboarding end to end, with the commands an operator types: three sites whose
images this test writes (PNG, JPEG, and DICOM in five transfer syntaxes, four of them compressed,
with a VOI window), each labelling a different subset of the federation's classes in its own
manifest, are provisioned (`afl provision`), checked (`afl-server check`), extracted
(`afl-client extract`), checked again (`afl-client doctor`, which prints the values masked rounds
use), and complete a MASK round whose bounds nobody set by hand (the sites declare them at
enrolment, docs/protocol.md §4.2). Oracles: the pooled ridge solve in numpy on the caches
(balanced targets built here), and the plan's bounds recomputed from the caches' row counts and
norms as powers of two."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

from afl.client.cli import main as client_main
from afl.core.data.featurecache import open_cache
from afl.lab.cli import main as afl_main
from afl.lab.demo.federation import free_port
from afl.proto.v1 import common_pb2
from afl.server import toml_text
from afl.server.daemon.main import main as server_main
from afl.server.store import Store
from tests.client.imagegen import write_hospital
from tests.helpers.numeric import pooled_ridge, relative_error

CLASSES = ["Atelectasis", "Effusion", "Mass", "Pneumothorax"]
LABELS = {
    "hospital-a": ["Atelectasis", "Effusion", "Pneumothorax"],
    "hospital-b": ["Effusion", "Mass", "Pneumothorax"],
    "hospital-c": ["Atelectasis", "Mass"],
}
IMAGES = 12
# Random-init DenseNet features have row norms near 3e4 (Gram diagonal near 1e8); γ on that scale
# keeps A well conditioned, so comparing W at 1e-9 (M-40's tolerance) measures the protocol's
# fixed-point sums, not float64 round-off of an ill-conditioned solve.
GAMMA = 1.0e6


def _declared(cache: Path) -> tuple[float, float]:
    """(N̂·L̂², 2·L̂) with N̂, L̂ the powers of two >= the cache's rows and largest row norm."""
    h = np.asarray(open_cache(cache).features, dtype=np.float64)
    rows = 2 ** math.ceil(math.log2(h.shape[0]))
    norm = 2.0 ** math.ceil(math.log2(float(np.linalg.norm(h, axis=1).max()) * (1 + 2**-20)))
    return rows * norm**2, 2 * norm


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_three_partial_sites_from_images_to_a_masked_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    sites = list(LABELS)
    fed = tmp_path / "federation"
    argv = ["provision", "--out", str(fed), "--port", str(port)]
    assert afl_main([*argv, *(a for s in sites for a in ("--site", s))]) == 0
    server_toml = fed / "server" / "server.toml"
    doc = tomllib.loads(server_toml.read_text(encoding="utf-8"))
    doc["round"].update(
        classes=CLASSES,
        feature_dim=1024,
        backbone="xrv-densenet121-all",
        aggregation="mask",  # no mask_* bound: the sites declare theirs
        gamma=GAMMA,
        allow_random_init=True,  # a test federation: no trained weights offline
        enrol_timeout_s=120.0,
        upload_timeout_s=300.0,
    )
    server_toml.write_text(toml_text.dumps(doc), encoding="utf-8")
    assert server_main(["check", "--config", str(server_toml)]) == 0
    assert "ready to start" in capsys.readouterr().out

    caches = {}
    for i, site in enumerate(sites):
        kind = ("png", "jpeg", "dicom")[i]
        folder = tmp_path / "images" / site
        manifest = write_hospital(folder, kind=kind, classes=LABELS[site], count=IMAGES, seed=i)
        kit = fed / "sites" / site
        caches[site] = kit / "cache"  # where the provisioned client.toml's [data] cache points
        assert 'cache = "cache"' in (kit / "client.toml").read_text(encoding="utf-8")
        extract = ["extract", "--manifest", str(manifest), "--backbone", "xrv-densenet121-all"]
        extract += ["--random-init", "--out", str(caches[site]), "--batch-size", "6"]
        assert client_main([*extract, "--workers", "0", "--no-progress"]) == 0
        assert open_cache(caches[site]).meta.n == IMAGES  # every format, every syntax decoded
    capsys.readouterr()

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = tmp_path / "logs"
    logs.mkdir()
    server = subprocess.Popen(
        [sys.executable, "-m", "afl.server.daemon.main", "--config", str(server_toml)],
        stdout=subprocess.DEVNULL,
        stderr=(logs / "server.log").open("wb"),
        env=env,
    )
    clients: dict[str, subprocess.Popen[bytes]] = {}
    try:
        deadline = time.monotonic() + 60
        while "listening" not in (logs / "server.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        for site in sites:
            config = fed / "sites" / site / "client.toml"
            assert client_main(["doctor", "--config", str(config)]) == 0
            out = capsys.readouterr().out
            assert "mutual TLS" in out and "ready:" in out
            assert f"N = {IMAGES} rows" in out and "declared at enrolment as N <= 16" in out
            for name in LABELS[site]:
                assert f"class {name}: 6 positive, 6 negative" in out
        for site in sites:
            config = fed / "sites" / site / "client.toml"
            clients[site] = subprocess.Popen(
                [sys.executable, "-m", "afl.client.cli", "run", "--config", str(config)],
                stdout=subprocess.DEVNULL,
                stderr=(logs / f"{site}.log").open("wb"),
                env=env,
            )
        for site, proc in clients.items():
            code = proc.wait(timeout=600)
            assert code == 0, f"{site}: {(logs / f'{site}.log').read_text()[-3000:]}"
        assert server_main(["status", "--config", str(server_toml)]) == 0
        status = capsys.readouterr().out
        assert ": PUBLISHED\n" in status and "last error: none" in status
        assert (
            client_main(["status", "--config", str(fed / "sites" / sites[0] / "client.toml")]) == 0
        )
        assert "last round" in capsys.readouterr().out
    finally:
        for proc in clients.values():
            _stop(proc)
        _stop(server)

    # The plan's bounds are the sites' declarations, and nobody wrote one into server.toml.
    assert tomllib.loads(server_toml.read_text())["round"]["mask_gram_bound"] == 0.0
    store = Store(
        fed / "server" / "state", federation_id=doc["server"]["federation_id"], read_only=True
    )
    try:
        row = store.rounds()[-1]
        assert row.plan is not None
        plan = common_pb2.ReleasePlan.FromString(row.plan)
    finally:
        store.close()
    declared = {s: _declared(c) for s, c in caches.items()}
    for release in plan.releases:
        gram, vector = (max(v[i] for v in declared.values()) for i in (0, 1))
        want = gram if release.kind == common_pb2.STATISTIC_KIND_GRAM else vector
        assert release.encoding.fixed_point.bound == want, release.name
    # Every site holds the same verified model, equal to the pooled solve.
    oracle = pooled_ridge(caches.values(), classes=CLASSES, gamma=GAMMA)
    for site in sites:
        state = fed / "sites" / site / "state"
        (weights,) = list((state / "models").glob("*.weights.npy"))
        assert relative_error(np.load(weights), oracle) < 1e-9, site
    reports = [p for s in sites for p in (fed / "sites" / s / "state" / "reports").glob("*.json")]
    notes = [p.read_text() for p in reports]
    assert all('"outcome": "COMPLETED"' in text for text in notes)
    assert any("contributes nothing for" in text for text in notes)  # partial sites say so
