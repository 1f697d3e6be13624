"""The federation of the fault suite: a few sites on generated data, their statistics' oracle
(an independent solve of the plaintext sums, :func:`afl.core.aggregation.federated_solve`) and
helpers to read the coordinator's state folder. The daemons are run by
:class:`tests.e2e.processes.Daemons`; the faults are injected by tests/e2e/faulty_server.py."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.aggregation import federated_solve
from afl.lab.demo.federation import (
    LoopbackFederation,
    ckks_round_settings,
    mask_round_settings,
    prepare_loopback,
)
from afl.proto.v1 import coordinator_pb2 as pb
from tests.e2e.loopback import SiteData, cached_statistics
from tests.e2e.processes import SERVER_COMMAND, Daemons
from tests.helpers.numeric import relative_error

CLASSES = ("A", "B", "C")
DATA = SiteData(d=10, classes=len(CLASSES), rows=60, rows_step=10, positive_rate=0.4, seed=11)


def federation(
    root: Path,
    mode: str = "plaintext",
    *,
    sites: int = 3,
    data: SiteData = DATA,
    serve: bool = False,
    evaluate: bool = False,
    round_settings: Mapping[str, Any] | None = None,
    server_tables: Mapping[str, Mapping[str, Any]] | None = None,
    policy: Mapping[str, Any] | None = None,
) -> LoopbackFederation:
    """A loopback federation of ``sites`` sites in ``mode`` (the kits allow plaintext), every
    site's [policy] updated with ``policy``."""
    feats, labels = data.draw(sites)
    settings: dict[str, Any] = {
        "gram_scope": "global",
        "aggregation": mode,
        "upload_timeout_s": 300.0,
        "enrol_timeout_s": 300.0,
        "evaluate": evaluate,
        "min_participants": sites,
        **(round_settings or {}),
    }
    if mode == "mask":
        settings.update(mask_round_settings(feats))
    if mode == "ckks":
        settings.update(ckks_round_settings(feats))
    return prepare_loopback(
        root,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        active=np.ones((sites, len(CLASSES)), dtype=bool),
        test_features=feats[0][:20],
        test_labels=labels[0][:20],
        round_settings=settings,
        decryptor=mode == "ckks",
        client_settings={"serve": serve},
        server_tables=server_tables,
        allow_plaintext=mode == "plaintext",
        policy={f"site-{i + 1}": dict(policy) for i in range(sites)} if policy else None,
    )


def oracle(loop: LoopbackFederation) -> NDArray[np.float64]:
    """W of an independent solve of every site's plaintext statistics."""
    stats, _ = cached_statistics(loop, list(loop.site_ids))
    weights, _ = federated_solve(stats, gamma=1.0, gram_scope="global")
    return np.asarray(weights, dtype=np.float64)


def weights(signed: pb.SignedModel) -> NDArray[np.float64]:
    """The published W of a signed model."""
    model = pb.Model.FromString(signed.model)
    return np.frombuffer(model.weights.data, dtype="<f8").reshape(tuple(model.weights.shape))


def contributors(signed: pb.SignedModel) -> list[str]:
    return sorted(pb.Model.FromString(signed.model).contributors)


def assert_every_site_in_the_model(daemons: Daemons, run_id: str) -> None:
    """``run_id`` published a model of every site whose W is the independent solve's."""
    info = daemons.wait_run(run_id)
    assert info.state == "published", (info, daemons.log_tail())
    signed = daemons.model(run_id)
    assert contributors(signed) == sorted(daemons.loop.site_ids)
    assert relative_error(weights(signed), oracle(daemons.loop)) <= 1e-9


def state_dir(loop: LoopbackFederation) -> Path:
    return loop.server_config.parent / "state"


def site_state(loop: LoopbackFederation, site: str) -> Path:
    return loop.client_configs[site].parent / "state"


def payload_files(loop: LoopbackFederation) -> list[Path]:
    root = state_dir(loop) / "payloads"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []


def audit_events(loop: LoopbackFederation) -> list[tuple[str, dict[str, Any]]]:
    """(event, detail) of the coordinator's audit log, read from its database."""
    import sqlite3

    db = sqlite3.connect(f"file:{state_dir(loop) / 'server.sqlite3'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT event, detail FROM audit_log ORDER BY seq").fetchall()
    finally:
        db.close()
    return [(r[0], json.loads(r[1])) for r in rows]


def wait_for(
    what: str, condition: Callable[[], bool], *, timeout_s: float, logs: Callable[[], str]
) -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` with the logs."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen in {timeout_s:g} s\n{logs()}")
        time.sleep(0.3)


def server_tool(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``afl-server ARGS`` (e.g. ``backup``, ``ack-restore``) to its end."""
    return subprocess.run(
        [*SERVER_COMMAND, *args], capture_output=True, text=True, timeout=300, check=False
    )


def stop_server(daemons: Daemons) -> None:
    """SIGTERM the coordinator and wait for its clean exit."""
    assert daemons.server is not None
    daemons.server.send_signal(signal.SIGTERM)
    assert daemons.server.wait(timeout=120) == 0, daemons.log_tail()


def restore(loop: LoopbackFederation, backup: Path) -> None:
    """Replace the (stopped) coordinator's state folder by ``backup``."""
    shutil.rmtree(state_dir(loop))
    shutil.copytree(backup, state_dir(loop))
