"""Runs of a federation and the Admin service (docs/operations.md "Runs and the admin
interface"): submissions are validated and queue behind the active run, aborts release nothing,
a run's settings survive as a table, and only listed admin certificates open the service while
site certificates never do (and admin certificates are never sites)."""

from __future__ import annotations

import dataclasses
import hashlib
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.identity import pki, signatures
from afl.proto.v1 import admin_pb2 as apb
from afl.proto.v1 import admin_pb2_grpc, coordinator_pb2_grpc
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.admin import AdminRequests, parse_run_settings
from afl.server.config import load_config, run_settings, settings_table
from afl.server.coordinator import Coordinator
from afl.server.errors import InvalidRequestError, NotPermittedError, WrongStageError
from afl.server.plan.dp import DpSettings
from afl.server.servicer import AdminServicer, CoordinatorServicer
from afl.server.store import Store
from tests.helpers.federation import FederationSpec
from tests.helpers.inprocess import complete_round, enrol

SITES = ["p1", "p2", "p3"]
FEDERATION = FederationSpec(
    sites=SITES,
    round_settings={"classes": ["a", "b"], "feature_dim": 2, "min_participants": 3},
)


def _coordinator(federation: Any, state: Path, **config_changes: Any) -> Coordinator:
    config = load_config(federation.server_dir / "server.toml")
    config = replace(config, state_dir=state, **config_changes)
    key = signatures.load_private_key_pem((federation.server_dir / "identity.key").read_bytes())
    return Coordinator(config, Store(state, federation_id=config.federation_id), key)


def test_runs_queue_behind_the_active_run_and_abort_releases_nothing(
    federation: Any, tmp_path: Path
) -> None:
    coordinator = _coordinator(federation, tmp_path / "state")
    admin = AdminRequests(coordinator)
    for site in SITES:
        enrol(coordinator, federation, site)
    assert [r.state for r in coordinator.store.runs()] == ["active"]
    two = admin.submit(
        "operator", apb.SubmitRunRequest(name="b only", settings_toml='classes = ["b"]')
    )
    three = admin.submit("operator", apb.SubmitRunRequest(settings_toml="[round]\ngamma = 2.0\n"))
    assert (two.run_id, two.state, three.state) == ("run-2", "queued", "queued")
    with pytest.raises(InvalidRequestError, match="gram_scope"):
        admin.submit("operator", apb.SubmitRunRequest(settings_toml='gram_scope = "sideways"'))
    with pytest.raises(InvalidRequestError, match="not valid TOML"):
        admin.submit("operator", apb.SubmitRunRequest(settings_toml="classes = ["))
    # The active run's open round is aborted by the admin: nothing released, run-2 starts.
    aborted = admin.abort("operator", apb.AbortRunRequest(run_id="run-1", reason="wrong data"))
    assert aborted.state == "aborted" and "aborted by admin operator: wrong data" in aborted.reason
    assert aborted.round_history[-1].stage == pb.ROUND_STAGE_ABORTED and not aborted.model_round_id
    with pytest.raises(WrongStageError, match="already ended"):
        admin.abort("operator", apb.AbortRunRequest(run_id="run-1"))
    admin.abort("operator", apb.AbortRunRequest(run_id="run-3", reason="not needed"))
    current = admin.get("operator", "run-2")
    assert current.state == "active" and list(current.classes) == ["b"]
    complete_round(coordinator, federation)
    published = admin.get("operator", "run-2")
    assert published.state == "published" and published.model_round_id
    signed = admin.model("operator", "run-2")
    assert hashlib.sha256(signed.model).digest() == published.model_sha256
    assert list(pb.Model.FromString(signed.model).class_names) == ["b"]
    states = {r.run_id: r.state for r in admin.list("operator").runs}
    assert states == {"run-1": "aborted", "run-2": "published", "run-3": "aborted"}
    logs = admin.logs("operator", apb.LogRequest(run_id="run-3"))
    # The run's records, and each admin call about it (docs/protocol.md M-161).
    assert [r.event for r in logs.records] == [
        "run-submitted",
        "admin-call",
        "run-finished",
        "admin-call",
    ]
    assert logs.count == len(coordinator.store.audit_entries())


def test_a_restarted_coordinator_keeps_its_runs(federation: Any, tmp_path: Path) -> None:
    first = _coordinator(federation, tmp_path / "state")
    AdminRequests(first).submit("operator", apb.SubmitRunRequest(settings_toml="gamma = 3.0"))
    first.store.close()
    again = _coordinator(federation, tmp_path / "state")
    runs = again.store.runs()
    assert [(r.run_id, r.state) for r in runs] == [("run-1", "active"), ("run-2", "queued")]
    assert again.machine.run("run-2").settings.gamma == 3.0


def test_only_listed_admins_are_served(federation: Any, tmp_path: Path) -> None:
    admin = AdminRequests(_coordinator(federation, tmp_path / "state"))
    admin.list("operator")
    with pytest.raises(NotPermittedError, match="not listed"):
        admin.list("intruder")
    closed = AdminRequests(_coordinator(federation, tmp_path / "closed", admins=()))
    with pytest.raises(NotPermittedError, match="lists no"):
        closed.list("operator")


def test_submitted_settings_may_carry_a_round_header() -> None:
    assert parse_run_settings("[round]\nrounds = 2\n") == {"rounds": 2}
    assert parse_run_settings("rounds = 2\n[dp]\nepsilon = 1.0\n") == {
        "rounds": 2,
        "dp": {"epsilon": 1.0},
    }


@settings(max_examples=40, deadline=None)
@given(
    scope=st.sampled_from(["global", "per-class"]),
    mode=st.sampled_from(["plaintext", "mask"]),
    rounds=st.sampled_from([1, 2]),
    gamma=st.floats(0.01, 100.0),
    dp=st.booleans(),
    colluders=st.floats(0.0, 0.5),
    calibration=st.sampled_from(["platt", "isotonic", "none"]),
    eval_rows=st.integers(0, 10**6),
)
def test_run_settings_round_trip_through_their_table(
    federation: Any,
    scope: str,
    mode: str,
    rounds: int,
    gamma: float,
    dp: bool,
    calibration: str,
    eval_rows: int,
    colluders: float,
) -> None:
    config = load_config(federation.server_dir / "server.toml")
    mask: dict[str, Any] = (
        {"mask_gram_bound": 100.0, "mask_vector_bound": 2.0} if mode == "mask" else {}
    )
    if mode == "mask" and scope == "global":  # a sparse masking graph (global scope only)
        mask.update(mask_graph="sparse", mask_colluder_fraction=colluders, mask_security_bits=50)
    table = {
        **settings_table(config.round),
        "gram_scope": scope,
        "aggregation": mode,
        "rounds": 1 if dp else rounds,
        "gamma": gamma,
        "evaluate": not dp,  # evaluation releases carry no DP noise: not in DP runs
        "eval_calibration": calibration,
        "eval_max_rows": eval_rows,
        **mask,
    }
    if dp:
        table["dp"] = dataclasses.asdict(DpSettings(epsilon=2.0, delta=1e-5, clip_norm=1.0))
        if mode == "mask":
            table["mask_max_samples"] = 100
    settings = run_settings(table, source="test", sites=config.sites)
    assert run_settings(settings_table(settings), source="again", sites=config.sites) == settings


# --- over gRPC with real TLS --------------------------------------------------------------------


def _serve(coordinator: Coordinator) -> tuple[grpc.Server, int]:
    config = coordinator.config
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(coordinator), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(coordinator), server)
    credentials = grpc.ssl_server_credentials(
        [(config.key.read_bytes(), config.cert.read_bytes())],
        root_certificates=config.ca_cert.read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, port


def _channel(federation: Any, port: int, key: bytes, cert: bytes) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(federation.root / "ca.pem").read_bytes(),
        private_key=key,
        certificate_chain=cert,
    )
    return grpc.secure_channel(f"localhost:{port}", credentials)


def test_admin_and_site_certificates_open_only_their_own_service(
    federation: Any, tmp_path: Path
) -> None:
    server, port = _serve(_coordinator(federation, tmp_path / "state"))
    kit = federation.root / "admins" / "operator"
    site = federation.site_dirs["p1"]
    try:
        with _channel(
            federation, port, (kit / "admin.key").read_bytes(), (kit / "admin.pem").read_bytes()
        ) as ch:
            runs = admin_pb2_grpc.AdminStub(ch).ListRuns(apb.ListRunsRequest(), timeout=20).runs
            assert [r.run_id for r in runs] == ["run-1"]
            with pytest.raises(grpc.RpcError) as info:
                coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(pb.StatusRequest(), timeout=20)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with _channel(
            federation, port, (site / "site.key").read_bytes(), (site / "site.pem").read_bytes()
        ) as ch:
            with pytest.raises(grpc.RpcError) as info:
                admin_pb2_grpc.AdminStub(ch).ListRuns(apb.ListRunsRequest(), timeout=20)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "afl-admin" in (info.value.details() or "")
    finally:
        server.stop(None)


def test_admin_certificates_name_an_admin_and_never_a_site(federation: Any) -> None:
    pem = (federation.root / "admins" / "operator" / "admin.pem").read_bytes()
    assert pki.admin_name_from_pem(pem) == "operator"
    with pytest.raises(pki.PkiError, match="afl-site"):
        pki.site_id_from_pem(pem)
    site_pem = (federation.site_dirs["p1"] / "site.pem").read_bytes()
    with pytest.raises(pki.PkiError, match="afl-admin"):
        pki.admin_name_from_pem(site_pem)
