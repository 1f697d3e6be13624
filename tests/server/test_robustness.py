"""What a site can do to an honest coordinator must not crash, hang, starve or corrupt it
(docs/protocol.md §3, §9, §10, §11): afl-server over loopback gRPC with real mutual TLS, driven by
minimal fake sites (tests/server/fakeclient.py).

* Values: two finite uploads that overflow to inf when summed abort the round with the reason
  (audit log and operator's log), and a server restarted on such stored data starts and aborts
  the round instead of crash-looping.
* Streams: one enrolled site holding 40 WatchRounds and 40 stalled uploads gets
  RESOURCE_EXHAUSTED beyond its per-site limits while the other sites' round completes; its
  stalled uploads are closed after the idle timeout.
* Reports: a malformed report is INVALID_ARGUMENT and changes nothing; a replaced report is
  audited, so the stored report and the audit log agree.
* State files are 0600 and folders 0700; a per-class federation says why a site that discloses
  no coverage cannot enrol.
"""

from __future__ import annotations

import hashlib
import logging
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from afl.core.aggregation import federated_solve
from afl.core.stats import LocalStats
from afl.crypto.transparency.statements import decode_statement
from afl.ops.provisioning import ProvisionedFederation
from afl.proto.v1 import common_pb2, coordinator_pb2
from afl.server.config import load_config
from afl.server.daemon.main import CoordinatorServer
from afl.server.limits import StreamLimits
from afl.server.plan.history import stored_history
from afl.server.rounds import Stage
from afl.server.store import Store
from tests.helpers.federation import FederationSpec
from tests.helpers.numeric import relative_error
from tests.server.fakeclient import FakeSite, chunks, enrol_and_accept, make_stats, payload

SITES = ["s1", "s2", "s3"]
CLASSES = ["a", "b"]
D = 6
Code = grpc.StatusCode
FEDERATION = FederationSpec(
    sites=[*SITES, "greedy"],
    federation_id="fed-robust",
    round_settings={"classes": CLASSES, "feature_dim": D, "min_participants": 3},
)


@pytest.fixture(scope="module")
def stats() -> dict[str, LocalStats]:
    rng = np.random.default_rng(5)
    return {s: make_stats(rng, n=30, d=D, classes=CLASSES, labelled=CLASSES) for s in SITES}


def _start(
    federation: ProvisionedFederation,
    state: Path,
    limits: StreamLimits | None = None,
    **round_: Any,
) -> CoordinatorServer:
    config = load_config(federation.server_dir / "server.toml")
    config = replace(
        config,
        listen="127.0.0.1:0",
        state_dir=state,
        round=replace(config.round, participants=tuple(SITES), **round_),
        limits=limits or config.limits,
        payload_retention_days=30.0,  # the tests inspect and reuse stored payloads
    )
    server = CoordinatorServer(config, tick_s=0.05)
    server.start()
    return server


@pytest.fixture
def servers() -> Iterator[list[CoordinatorServer]]:
    started: list[CoordinatorServer] = []
    yield started
    for server in started:
        server.stop(None)


def _connect(federation: ProvisionedFederation, port: int, names: list[str]) -> dict[str, FakeSite]:
    return {s: FakeSite(s, federation.site_dirs[s], port) for s in names}


def _key(federation: ProvisionedFederation) -> bytes:
    return load_config(federation.server_dir / "server.toml").identity_public_key


def _open_round(
    sites: dict[str, FakeSite], key: bytes
) -> tuple[coordinator_pb2.RoundConfig, common_pb2.ReleasePlan]:
    return enrol_and_accept(sites, key, coverage=dict.fromkeys(sites, CLASSES), d=D)


def _code(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), str(info.value.details())


def _wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


# --- values ----------------------------------------------------------------------------------


def test_overflowing_sums_abort_the_round_and_a_restarted_server_starts(
    federation: ProvisionedFederation,
    servers: list[CoordinatorServer],
    stats: dict[str, LocalStats],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = tmp_path / "state"
    servers.append(_start(federation, state))
    sites = _connect(federation, servers[-1].port, SITES)
    config, plan = _open_round(sites, _key(federation))
    target = next(r for r in plan.releases if r.name == "b[a]")
    caplog.set_level(logging.ERROR, logger="afl.server.solve")
    for s, site in sites.items():
        for release in plan.releases:
            data = payload(release, stats[s], CLASSES)
            if release.name == target.name and s in ("s1", "s2"):
                values = np.frombuffer(data, dtype="<f8").copy()
                values[0] = 1.7e308  # finite; the sum of two is inf
                data = values.tobytes()
            site.send(chunks(config.round_id, release.name, data))
    status = sites["s1"].status().round
    assert status.stage == coordinator_pb2.ROUND_STAGE_ABORTED
    reason = "solve failed: the sum of release 'b[a]' is not finite (overflow or NaN)"
    assert status.abort_reason == reason
    assert any(r.message == "solve failed" and r.reason == reason[14:] for r in caplog.records)  # type: ignore[attr-defined]
    servers[-1].stop(None)
    # The coordinator decoded the sums before the solve failed: the federation log records
    # their release (unpublished) before the abort, so every site's whole-history audit counts it.
    store = Store(state, federation_id="fed-robust")
    logged = [
        (kind, decode_statement(entry, federation="fed-robust")[1])
        for _, kind, entry, _ in store.log_entries(0, store.log_size())
    ]
    history = dict(stored_history(store))  # the coordinator's own audit (M-124) counts it
    store.close()
    assert {m for r in history[config.round_id] for m in r.members} == set(SITES)
    ends = [(k, f) for k, f in logged if f.get("round_id") == config.round_id and k != "plan"]
    assert [k for k, _ in ends] == ["release", "round-aborted"], ends
    assert ends[0][1]["published"] is False
    assert ends[0][1]["survivors"] == sorted(SITES)
    # What a server without this check left behind: the round stuck in SOLVING on the stored
    # overflowing uploads. A restart must start, and abort the round with the reason.
    store = Store(state, federation_id="fed-robust")
    store.update_round(config.round_id, stage=Stage.SOLVING, deadline_ms=0)
    store.close()
    servers.append(_start(federation, state))
    assert _connect(federation, servers[-1].port, ["s1"])["s1"].status().round.stage == (
        coordinator_pb2.ROUND_STAGE_ABORTED
    )
    store = Store(state, federation_id="fed-robust")
    try:
        stages = [e[2] for e in store.audit_entries() if e[1] == "stage"]
        assert [s["reason"] for s in stages if s["stage"] == "ROUND_STAGE_ABORTED"] == [reason] * 2
        assert store.verify_audit_chain() and store.model() is None
    finally:
        store.close()


def test_indefinite_or_non_finite_systems_are_refused_with_a_reason() -> None:
    from afl.core.aggregation import AggregationError, factor_regularised

    with pytest.raises(AggregationError, match="not positive definite"):
        factor_regularised(-np.eye(3), 0.5)
    with pytest.raises(AggregationError, match="NaN or infinite"):
        factor_regularised(np.full((3, 3), np.inf), 0.5)


# --- streams ---------------------------------------------------------------------------------


def test_one_site_holding_streams_does_not_starve_the_others(
    federation: ProvisionedFederation,
    servers: list[CoordinatorServer],
    stats: dict[str, LocalStats],
    tmp_path: Path,
) -> None:
    limits = StreamLimits(upload_idle_timeout_s=20.0)  # per site: 2 watches, 2 uploads
    servers.append(_start(federation, tmp_path / "state", limits=limits))
    port, key = servers[-1].port, _key(federation)
    greedy = _connect(federation, port, ["greedy"])["greedy"]
    greedy.enroll()
    watches = [greedy.stub.WatchRounds(coordinator_pb2.WatchRequest()) for _ in range(40)]
    release = threading.Event()  # the stalled uploads send one chunk, then nothing

    def stalled() -> Iterator[coordinator_pb2.UploadChunk]:
        yield chunks("r1-x", "gram[all]", bytes(64), size=8)[0]
        release.wait(120)

    uploads = [greedy.stub.Upload.future(stalled(), timeout=120) for _ in range(40)]
    try:
        _wait_for(lambda: sum(w.done() for w in watches) >= 38, "the excess watches")
        _wait_for(lambda: sum(u.done() for u in uploads) >= 38, "the excess uploads")
        refused = [w for w in watches if w.done()]
        assert len(refused) == 38 and all(w.code() == Code.RESOURCE_EXHAUSTED for w in refused)
        assert "already holds 2 watch stream(s)" in refused[0].details()
        assert "[limits] watch_streams_per_site = 2" in refused[0].details()
        turned_away = [u for u in uploads if u.done()]
        assert len(turned_away) == 38
        assert all(u.code() == Code.RESOURCE_EXHAUSTED for u in turned_away)
        # Meanwhile the other sites' round runs to its model.
        sites = _connect(federation, port, SITES)
        config, plan = _open_round(sites, key)
        for s, site in sites.items():
            site.upload_all(config, plan, stats[s])
        _, weights = sites["s1"].model(key)
        oracle, _ = federated_solve([stats[s] for s in SITES], gamma=1.0, gram_scope="global")
        assert relative_error(weights, oracle) <= 1e-9
        # The two stalled uploads are closed once no chunk came for the idle timeout...
        held = [u for u in uploads if not u.done()]
        assert len(held) == 2
        _wait_for(lambda: all(u.done() for u in held), "the idle timeout", timeout_s=90.0)
        assert all(u.code() == Code.DEADLINE_EXCEEDED for u in held)
        assert "no chunk within 20 s" in held[0].details()
        # ... which frees the site's slots: a new upload is served (and judged on its merits).
        code, _ = _code(lambda: greedy.send(chunks(config.round_id, "gram[all]", bytes(64))))
        assert code == Code.PERMISSION_DENIED  # not a participant, no longer "exhausted"
    finally:
        release.set()
        for watch in watches:
            watch.cancel()


# --- reports ---------------------------------------------------------------------------------


def _report(round_id: str, **fields: Any) -> coordinator_pb2.ClientReport:
    return coordinator_pb2.ClientReport(
        round_id=round_id,
        outcome=fields.pop("outcome", coordinator_pb2.CLIENT_OUTCOME_COMPLETED),
        reason=fields.pop("reason", ""),
        bytes_sent=fields.pop("bytes_sent", 100),
        **fields,
    )


def test_bad_reports_are_refused_and_the_stored_report_matches_the_audit_log(
    federation: ProvisionedFederation, servers: list[CoordinatorServer], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    servers.append(_start(federation, state))
    sites = _connect(federation, servers[-1].port, SITES)
    config, _ = _open_round(sites, _key(federation))
    rid, stub = config.round_id, sites["s1"].stub
    first = _report(rid, timings_s={"upload": 0.5})
    stub.SubmitReport(first, timeout=10)
    stub.SubmitReport(first, timeout=10)  # a retry changes nothing
    bad = [
        _report(rid, outcome=99),  # out-of-range enum: once replaced the report with INTERNAL
        _report(rid, outcome=coordinator_pb2.CLIENT_OUTCOME_UNSPECIFIED),
        _report(rid, reason="x" * 5000),
        _report(rid, warnings=["w"] * 1000),
        _report(rid, timings_s={"upload": float("nan")}),
        _report(rid, timings_s={"upload": -1.0}),
        _report(rid, budget=common_pb2.SiteBudget(site_id="s2", epsilon=1.0, delta=1e-5)),
    ]
    for report in bad:
        code, details = _code(lambda r=report: stub.SubmitReport(r, timeout=10))  # type: ignore[misc]
        assert code == Code.INVALID_ARGUMENT and details.startswith("report: "), details
    second = _report(rid, outcome=coordinator_pb2.CLIENT_OUTCOME_FAILED, reason="disk full")
    stub.SubmitReport(second, timeout=10)
    servers[-1].stop(None)
    store = Store(state, federation_id="fed-robust")
    try:
        stored = store.reports(rid)["s1"]
        assert stored == second.SerializeToString()
        logged = [e[2] for e in store.audit_entries() if e[1] == "client-report"]
        digest = hashlib.sha256  # the audit names each stored report and the one it replaces
        assert [e["sha256"] for e in logged] == [
            digest(first.SerializeToString()).hexdigest(),
            digest(stored).hexdigest(),
        ]
        assert logged[1]["replaces"] == logged[0]["sha256"]
        assert [e["outcome"] for e in logged] == [
            "CLIENT_OUTCOME_COMPLETED",
            "CLIENT_OUTCOME_FAILED",
        ]
        assert store.verify_audit_chain()
    finally:
        store.close()


# --- state files and coverage ----------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_state_files_are_private(
    federation: ProvisionedFederation,
    servers: list[CoordinatorServer],
    stats: dict[str, LocalStats],
    tmp_path: Path,
) -> None:
    state = tmp_path / "deep" / "state"
    servers.append(_start(federation, state))
    sites = _connect(federation, servers[-1].port, SITES)
    config, plan = _open_round(sites, _key(federation))
    for s, site in sites.items():
        site.upload_all(config, plan, stats[s])
    assert sites["s1"].status().round.stage == coordinator_pb2.ROUND_STAGE_PUBLISHED
    folders = [p for p in state.rglob("*") if p.is_dir()]
    files = [p for p in state.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"server.sqlite3", "server.sqlite3-wal", "server.sqlite3-shm"} <= names
    assert any(p.suffix == ".bin" for p in files) and len(folders) >= 3  # payloads/<round>/<site>
    assert {p.name: _mode(p) for p in [state, *folders]} == dict.fromkeys(
        [p.name for p in [state, *folders]], 0o700
    )
    assert {p.name: _mode(p) for p in files} == dict.fromkeys(names, 0o600)


def test_a_per_class_run_says_why_a_site_without_coverage_is_left_out(
    federation: ProvisionedFederation, servers: list[CoordinatorServer], tmp_path: Path
) -> None:
    """A site that keeps its coverage to itself enrols (a later run may be global), and a
    per-class run leaves it out with the reason in its status; disclosing admits it."""
    servers.append(_start(federation, tmp_path / "state", gram_scope="per-class"))
    site = _connect(federation, servers[-1].port, ["s1"])["s1"]
    assert site.enroll((), D).site_id == "s1"
    _wait_for(lambda: bool(site.status().note), "the run's note on s1")
    note = site.status().note
    assert "gram_scope = 'per-class'" in note and "disclose_coverage = true" in note
    assert site.enroll(CLASSES, D).site_id == "s1"
    _wait_for(lambda: not site.status().note, "s1 admitted once it disclosed its coverage")
