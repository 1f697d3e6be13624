"""docs/flower.md's `flwr run` works as written against the pinned flwr: its
marked blocks (tests/helpers/doc_commands.py) run verbatim — Flower's connection in
``$FLWR_HOME/config.toml``, ``flower-superlink`` on the simulation engine, ``flwr run`` with the
federation's server.toml and client.toml paths — on a loopback federation of three sites and one
masked round. The SuperLink listens where the document's connection says (the test waits there
before ``flwr run``). Oracle: the in-process solve on the sites' caches (numpy, ≤ 1e-9 relative).

Needs the Flower extra (``afl[flower]``, installed by ``make venv``)."""

from __future__ import annotations

import shutil
import socket
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from afl.core.aggregation import federated_solve
from afl.lab.demo.federation import LoopbackRun, site_reports
from tests.e2e.loopback import SiteData, cached_statistics
from tests.helpers.doc_commands import (
    Party,
    Step,
    StepRunner,
    base_environment,
    doc_steps,
    used_variables,
    variables_block,
)
from tests.helpers.flower_nodes import CLASSES, small_federation
from tests.helpers.numeric import relative_error

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "flower.md"
DATA = SiteData(d=16, classes=len(CLASSES), rows=120, rows_step=20, positive_rate=0.4, seed=7)


def _steps() -> list[Step]:
    return doc_steps(DOC.read_text(encoding="utf-8"), document="docs/flower.md")


def _superlink_address(steps: list[Step]) -> tuple[str, int]:
    """The address of the document's Flower connection (its config.toml block)."""
    (edit,) = [s for s in steps if s.kind == "edit"]
    config = tomllib.loads(edit.body)
    host, _, port = config["superlink"][config["superlink"]["default"]]["address"].rpartition(":")
    return host, int(port)


def test_the_simulation_path_is_marked_and_self_contained() -> None:
    steps = _steps()
    assert [s.kind for s in steps] == ["variables", "edit", "start", "run"]
    assert steps[1].argument == "$FLWR_HOME/config.toml"
    assert steps[2].body.split()[:1] == ["flower-superlink"]
    assert steps[3].body.split()[:2] == ["flwr", "run"]
    declared = variables_block(steps) | {"HOME"}
    for step in steps:
        unknown = used_variables(step) - declared
        assert not unknown, f"{step.where()} uses {sorted(unknown)}, not in the variables block"
    # flwr 1.42's SuperLink serves the Control API on --host:--port, 127.0.0.1:8000 by default
    assert _superlink_address(steps) == ("127.0.0.1", 8000)
    text = DOC.read_text(encoding="utf-8")
    assert text.count("--control-api-address") == 1 and "are deprecated and not used" in text


def test_flwr_run_as_the_document_says_publishes_the_solve(tmp_path: Path) -> None:
    pytest.importorskip("flwr", reason="the Flower extra is not installed (make venv installs it)")
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray (the Flower extra)")
    steps = _steps()
    host, port = _superlink_address(steps)
    with socket.socket() as probe:
        busy = probe.connect_ex((host, port)) == 0
    assert not busy, f"{host}:{port} (the document's SuperLink address) is taken by another program"
    fed = small_federation(tmp_path / "fed", DATA, k=3, mode="mask", upload_timeout_s=300.0)
    checkout = tmp_path / "afl"  # the folder holding flower/app, as the document's reader has
    shutil.copytree(ROOT / "flower" / "app", checkout / "flower" / "app")
    env = base_environment()
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update(
        FED=str(fed.root / "federation"),
        FLWR_HOME=str(tmp_path / "flwr-home"),
        FLWR_DISABLE_UPDATE_CHECK="1",  # no network here
        RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
    )
    assert Path(env["FED"], "server", "server.toml") == fed.server_config
    party = Party("coordinator", checkout, env)
    runner = StepRunner(
        {"coordinator": party}, logs=tmp_path / "logs", listens=lambda p: (host, port)
    )
    try:
        for step in steps:
            runner.execute(step)
    finally:
        runner.stop()
    run = LoopbackRun(0, {}, site_reports(fed), 0.0)
    stats, _ = cached_statistics(fed, list(fed.site_ids))
    w_ref, _ = federated_solve(stats, gamma=1.0, gram_scope="global")
    for site in fed.site_ids:
        report = run.final_report(site)
        assert report["outcome"] == "COMPLETED", report
        assert report["transport"] == "flower"
        assert report["plan"]["aggregation"] == "AGGREGATION_MODE_MASK"
        w = np.asarray(np.load(report["model"]["path"]), dtype=np.float64)
        assert relative_error(w, w_ref) <= 1e-9
