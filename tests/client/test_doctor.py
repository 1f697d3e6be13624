"""`afl-client doctor` and `afl-client status` (afl.client.doctor) against a real afl-server over
mutual TLS: a ready site gets no PROBLEM and the values masked rounds use (N and the largest row
norm, measured here with numpy, and their powers of two); a missing cache, a misspelt class, a
partly labelled class, undeclared bounds and an unreachable server are each named."""

from __future__ import annotations

import math
import time
import tomllib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afl.client.cli import main as client_main
from afl.client.config import ClientConfig, DataConfig, LocalPolicy, load_client_config
from afl.client.doctor import doctor, status_lines
from afl.core.data.featurecache import CacheMeta, write_cache
from afl.crypto.identity.kit_check import OK, PROBLEM, WARNING, Finding
from afl.ops.provisioning import ProvisionedFederation
from afl.server import toml_text
from afl.server.config import load_config
from afl.server.daemon.main import CoordinatorServer
from tests.helpers.federation import FederationSpec
from tests.server.fakeclient import FakeSite

CLASSES = ("Atelectasis", "Effusion", "Mass")
D = 6
FEDERATION = FederationSpec(
    sites=["s1", "s2", "s3"], round_settings={"classes": list(CLASSES), "feature_dim": D}
)


@pytest.fixture(scope="module")
def server(
    federation: ProvisionedFederation, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CoordinatorServer]:
    config = load_config(federation.server_dir / "server.toml")
    running = CoordinatorServer(
        replace(config, listen="127.0.0.1:0", state_dir=tmp_path_factory.mktemp("state"))
    )
    running.start()
    yield running
    running.stop(None)


@pytest.fixture
def features() -> np.ndarray:
    return np.random.default_rng(3).normal(size=(20, D)).astype(np.float32) * 7.0


def _site(
    federation: ProvisionedFederation,
    server: CoordinatorServer,
    tmp_path: Path,
    features: np.ndarray,
    *,
    labels: np.ndarray | None = None,
    classes: tuple[str, ...] = ("Atelectasis", "Mass"),
    random_init: bool = False,
) -> ClientConfig:
    """Site s1 with a cache labelling ``classes`` (10 positives, 10 negatives each)."""
    n = features.shape[0]
    if labels is None:
        labels = np.tile((np.arange(n) % 2)[:, None], (1, len(classes))).astype(np.int8)
    meta = CacheMeta(
        n=n,
        d=D,
        classes=classes,
        source="test",
        random_init=random_init,
        extra={"backbone": "test"},
    )
    write_cache(
        tmp_path / "cache",
        meta=meta,
        ids=[str(i) for i in range(n)],
        labels=labels,
        features=features,
    )
    config = load_client_config(federation.site_dirs["s1"] / "client.toml")
    return replace(
        config,
        server_address=f"localhost:{server.port}",
        state_dir=tmp_path / "state",
        data=DataConfig(tmp_path / "cache"),
    )


def _messages(findings: list[Finding], level: str) -> list[str]:
    return [f.message for f in findings if f.level == level]


def test_a_ready_site_gets_its_values_and_no_problem(
    federation: ProvisionedFederation,
    server: CoordinatorServer,
    tmp_path: Path,
    features: np.ndarray,
) -> None:
    findings = doctor(_site(federation, server, tmp_path, features))
    assert _messages(findings, PROBLEM) == []
    ok = " | ".join(_messages(findings, OK))
    assert "mutual TLS" in ok and "this site is NOT yet enrolled" in ok
    assert "20 images x d = 6" in ok
    assert "class Atelectasis: 10 positive, 10 negative" in ok and "class Mass: 10 positive" in ok
    norm = float(np.linalg.norm(features.astype(np.float64), axis=1).max())
    power = 2.0 ** math.ceil(math.log2(norm))
    assert f"N = 20 rows, largest feature-row norm L = {norm:.6g}" in ok
    assert f"declared at enrolment as N <= 32, L <= {power:g}" in ok
    assert f"Gram bound {32 * power**2:g}" in ok and "nothing to set by hand" in ok


def test_each_problem_is_named(
    federation: ProvisionedFederation,
    server: CoordinatorServer,
    tmp_path: Path,
    features: np.ndarray,
) -> None:
    config = _site(federation, server, tmp_path, features)
    missing = doctor(replace(config, data=DataConfig(tmp_path / "nowhere")), connect=False)
    assert any("run `afl-client extract --out" in m for m in _messages(missing, PROBLEM))
    misspelt = doctor(replace(config, data=DataConfig(config.data.cache, ("Atelectasis", "Mas"))))
    assert any("'Mas' (did you mean 'Mass'?)" in m for m in _messages(misspelt, PROBLEM))
    labels = np.tile((np.arange(20) % 2)[:, None], (1, 2)).astype(np.int8)
    labels[:5, 1] = -1  # Mass labelled in 15 rows only
    partial = doctor(
        _site(federation, server, tmp_path / "p", features, labels=labels), connect=False
    )
    assert any("['Mass'] are labelled in some rows only" in m for m in _messages(partial, WARNING))
    private = replace(config, policy=LocalPolicy(disclose_row_bounds=False))
    assert any(
        "NOT declared" in m and "mask_max_samples >= 32" in m
        for m in _messages(doctor(private), WARNING)
    )
    away = replace(config, server_address="localhost:1")
    assert any("connection refused by localhost:1" in m for m in _messages(doctor(away), PROBLEM))


def _write_toml(
    config: ClientConfig, tmp_path: Path, **data: object
) -> tuple[Path, dict[str, Any]]:
    """``config`` as a client.toml in ``tmp_path`` (with its kit's files), ``data`` added to
    [data]."""
    doc = tomllib.loads(config.path.read_text())
    doc["client"].update(server=config.server_address, state_dir=str(config.state_dir))
    doc["data"] = {"cache": str(config.data.cache), "classes": [], **data}
    path = tmp_path / "client.toml"
    for name in ("ca.pem", "site.pem", "site.key", "identity.key"):
        (tmp_path / name).write_bytes((config.path.parent / name).read_bytes())
    path.write_text(toml_text.dumps(doc))
    return path, doc


def test_doctor_names_a_truncated_feature_file_and_the_fix(
    federation: ProvisionedFederation,
    server: CoordinatorServer,
    tmp_path: Path,
    features: np.ndarray,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """a features.npy cut short (an interrupted copy) is a PROBLEM line, not
    numpy's traceback."""
    config = _site(federation, server, tmp_path, features)
    path, _ = _write_toml(config, tmp_path)
    npy = config.data.cache / "features.npy"
    npy.write_bytes(npy.read_bytes()[: npy.stat().st_size // 2])
    assert client_main(["doctor", "--config", str(path), "--no-connect"]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    problem = [line for line in captured.out.splitlines() if str(npy) in line]
    assert len(problem) == 1 and "PROBLEM" in problem[0]
    assert "damaged" in problem[0] and "run `afl-client extract` again" in problem[0]


def test_status_names_the_signed_model_file_export_takes(
    federation: ProvisionedFederation,
    server: CoordinatorServer,
    tmp_path: Path,
    features: np.ndarray,
) -> None:
    """`afl-client status` names the file `afl export --model` needs."""
    config = _site(federation, server, tmp_path, features)
    models = config.state_dir / "models"
    models.mkdir(parents=True)
    (models / "r1.weights.npy").write_bytes(b"w")
    (models / "r1.signed-model.pb").write_bytes(b"m")
    last = [line for line in status_lines(config) if line.startswith("last model:")]
    assert last == [
        f"last model: {models / 'r1.signed-model.pb'} (signed; `afl export --model` takes this file)"
    ]


def test_cli_exit_codes_and_status(
    federation: ProvisionedFederation,
    server: CoordinatorServer,
    tmp_path: Path,
    features: np.ndarray,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = _site(federation, server, tmp_path, features)
    path, doc = _write_toml(config, tmp_path, clases=[])
    assert client_main(["doctor", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "unknown key [data] clases (did you mean 'classes'?)" in out and "ready:" in out
    doc["client"]["server"] = "localhost:1"
    path.write_text(toml_text.dumps(doc))
    assert client_main(["doctor", "--config", str(path)]) == 1
    assert "1 problem(s) found" in capsys.readouterr().out
    assert client_main(["doctor", "--config", str(tmp_path / "none.toml")]) == 2
    lines = status_lines(config)
    assert "coordinator" in lines[1] and "NOT enrolled" in lines[1]
    assert (
        "last round: none taken part in yet" in lines and "last model: none received yet" in lines
    )
    assert client_main(["status", "--config", str(path)]) == 0
    assert "UNREACHABLE: connection refused by localhost:1" in capsys.readouterr().out


def test_a_random_init_site_is_warned_and_told_why_the_run_leaves_it_out(
    federation: ProvisionedFederation,
    tmp_path: Path,
    features: np.ndarray,
) -> None:
    """A RANDOM-INIT cache is a WARNING of `doctor` before it joins; once enrolled, the run (no
    test) leaves it out, and `doctor` and `afl-client status` show the coordinator's reason."""
    config = load_client_config(federation.site_dirs["s1"] / "client.toml")
    own = CoordinatorServer(
        replace(load_config(federation.server_dir / "server.toml"), listen="127.0.0.1:0",
                state_dir=tmp_path / "server")
    )  # fmt: skip
    own.start()
    try:
        site = _site(federation, own, tmp_path, features, random_init=True)
        before = _messages(doctor(site), WARNING)
        assert any("RANDOM-INIT features (test only)" in m for m in before), before
        assert not any("left out" in m for m in before)
        FakeSite("s1", config.path.parent, own.port).enroll(
            ("Atelectasis", "Mass"), D, random_init=True
        )
        deadline = time.monotonic() + 60  # the run decides on the site at its next tick
        while not any("left out of the current run" in m for m in _messages(doctor(site), WARNING)):
            assert time.monotonic() < deadline, "the run never decided on the site"
            time.sleep(0.2)
        (line,) = [m for m in status_lines(site) if m.startswith("left out of the current run")]
        assert "RANDOM-INIT" in line and "allow_random_init" in line, line
    finally:
        own.stop(None)
