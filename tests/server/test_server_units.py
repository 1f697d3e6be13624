"""Unit tests of afl.server's pieces: config validation, the signed plan, the
store's audit chain and state checks, the error mapping and the daemon's command line."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from afl.crypto.errors import SignatureError
from afl.crypto.identity import signatures
from afl.crypto.identity.signed_blobs import PLAN_CONTEXT, verify_blob
from afl.ops.provisioning import ProvisionedFederation, ProvisioningError, provision
from afl.proto.v1 import common_pb2, coordinator_pb2
from afl.proto.wire import WireError, WireLimitError
from afl.server.config import load_config, round_template
from afl.server.daemon import main as daemon
from afl.server.errors import (
    ConfigError,
    ConflictError,
    InvalidRequestError,
    NotPermittedError,
    StateError,
    StoppingError,
    WrongStageError,
)
from afl.server.modes.base import decode_float64
from afl.server.plan.release import (
    _parsed_releases,
    build_plan,
    releases_from_plan,
    round1_releases,
    sign_plan,
)
from afl.server.servicer import status_for
from afl.server.store import Store
from tests.helpers.federation import FederationSpec

ROUND: dict[str, Any] = {"classes": ["a", "b"], "feature_dim": 8, "min_participants": 2}
FEDERATION = FederationSpec(sites=["x1", "x2"], round_settings=ROUND)


def test_provisioned_config_loads_with_round_settings(federation: ProvisionedFederation) -> None:
    config = load_config(federation.server_dir / "server.toml")
    assert config.round.classes == ("a", "b") and config.round.feature_dim == 8
    assert config.round.participants == ("x1", "x2") and config.round.gram_scope == "global"
    assert config.state_dir == federation.server_dir / "state"
    key = signatures.load_private_key_pem(config.identity_key.read_bytes())
    assert signatures.public_key_to_raw(key) == config.identity_public_key


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"classes": []}, "classes"),
        ({"feature_dim": 0}, "feature_dim"),
        ({"gram_scope": "per-site"}, "gram_scope"),
        ({"rounds": 3}, "rounds"),
        ({"gamma": -1.0}, "gamma"),
        ({"min_participants": 5}, "min_participants"),
        ({"participants": ["x1", "ghost"]}, "ghost"),
        ({"aggregation": "ckks"}, "aggregation"),
        ({"tau": 0.2}, "refinement"),
    ],
)
def test_bad_round_settings_are_named(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    fed = provision(tmp_path / "f", sites=["x1", "x2"], round_settings={**ROUND, **change})
    with pytest.raises(ConfigError, match=message):
        load_config(fed.server_dir / "server.toml")


def test_config_file_problems(tmp_path: Path, federation: ProvisionedFederation) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    text = (federation.server_dir / "server.toml").read_text()
    moved = tmp_path / "server.toml"  # relative paths no longer resolve
    moved.write_text(text)
    with pytest.raises(ConfigError, match=r"\[tls\] ca_cert"):
        load_config(moved)
    with pytest.raises(ConfigError, match="unknown"):
        round_template({"clases": ["a"]})
    with pytest.raises(ProvisioningError, match="unknown"):
        provision(tmp_path / "g", sites=["x1"], round_settings={"clases": ["a"]})
    assert tomllib.loads(text)["round"]["aggregation"] == "plaintext"


def test_decode_float64_checks_length_and_finiteness() -> None:
    values = np.arange(4, dtype="<f8")
    assert np.array_equal(decode_float64(values.tobytes(), length=4, what="x"), values)
    with pytest.raises(InvalidRequestError, match="needs 40"):
        decode_float64(values.tobytes(), length=5, what="x")
    values[2] = np.nan
    with pytest.raises(InvalidRequestError, match="NaN"):
        decode_float64(values.tobytes(), length=4, what="x")


# --- plan --------------------------------------------------------------------------------------


def test_plan_is_signed_over_its_bytes_and_round_trips() -> None:
    key = signatures.generate_identity_key()
    releases = round1_releases(
        classes=["a", "b", "c"],
        participants=["p3", "p1", "p2"],
        coverage={"p1": ["a", "b"], "p2": ["a"], "p3": ["a", "b"]},
        gram_scope="per-class",
        d=4,
        need_global_gram=True,
    )
    names = [r.name for r in releases]
    assert names[0] == "gram[all]" and "b[c]" not in names  # nobody labels c
    assert {r.name: r.members for r in releases}["b[b]"] == ("p1", "p3")
    plan = build_plan(
        federation_id="f",
        round_id="r1",
        round_number=1,
        participants=["p3", "p1", "p2"],
        gram_scope="per-class",
        releases=releases,
    )
    signed = sign_plan(plan, key)
    public = signatures.public_key_to_raw(key)
    verify_blob(public, context=PLAN_CONTEXT, blob=signed.plan, signature=signed.signature)
    with pytest.raises(SignatureError):
        verify_blob(public, context="model", blob=signed.plan, signature=signed.signature)
    assert releases_from_plan(signed.plan) == releases
    parsed = common_pb2.ReleasePlan.FromString(signed.plan)
    assert list(parsed.participants) == ["p1", "p2", "p3"] and len(parsed.round_salt) == 32
    # The round machine reads the open round's plan on every request: parsed once per plan,
    # and each caller gets its own list.
    hits = _parsed_releases.cache_info().hits
    mine = releases_from_plan(signed.plan)
    assert mine == releases and _parsed_releases.cache_info().hits == hits + 1
    mine.clear()
    assert releases_from_plan(signed.plan) == releases


# --- store, errors, daemon ---------------------------------------------------------------------


def test_one_site_s_plan_decision_is_read_alone(tmp_path: Path) -> None:
    store = Store(tmp_path / "s", federation_id="f1")
    store.put_decision("r1", "s1", accept=True, reason="")
    store.put_decision("r1", "s2", accept=False, reason="too few rows")
    store.put_decision("r2", "s1", accept=False, reason="no")
    assert store.decision("r1", "s1") == (True, "") == store.decisions("r1")["s1"]
    assert store.decision("r1", "s2") == (False, "too few rows") == store.decisions("r1")["s2"]
    assert store.decision("r2", "s1") == (False, "no")
    assert store.decision("r1", "s3") is None and store.decision("r3", "s1") is None


def test_store_audit_chain_and_state_checks(tmp_path: Path) -> None:
    store = Store(tmp_path / "s", federation_id="f1")
    store.audit("one", {"a": 1})
    store.audit("two", {"b": [1, 2]})
    assert store.verify_audit_chain()
    row = store.put_upload(
        "r", "x1", "gram[all]", data=b"abc", sha256=hashlib.sha256(b"abc").digest()
    )
    assert Store.read_payload(row) == b"abc"
    row.path.write_bytes(b"abd")
    with pytest.raises(StateError, match="digest"):
        Store.read_payload(row)
    store._db.execute("UPDATE audit_log SET detail = '{}' WHERE seq = 1")
    assert not store.verify_audit_chain()
    store.close()
    with pytest.raises(StateError, match="federation"):
        Store(tmp_path / "s", federation_id="other")


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequestError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (NotPermittedError("x"), grpc.StatusCode.PERMISSION_DENIED),
        (WrongStageError("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (ConflictError("x"), grpc.StatusCode.ALREADY_EXISTS),
        (StoppingError("x"), grpc.StatusCode.UNAVAILABLE),
        (WireLimitError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (WireError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (SignatureError("x"), grpc.StatusCode.PERMISSION_DENIED),
        (KeyError("secret detail"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_for_maps_each_error_class(error: Exception, code: grpc.StatusCode) -> None:
    got, message = status_for(error)
    assert got == code
    assert "secret detail" not in message


def test_daemon_exits_2_on_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert daemon.main(["--config", str(tmp_path / "nope.toml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_insecure_mode_warns_and_takes_the_site_from_metadata(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    from dataclasses import replace

    from afl.proto.v1 import coordinator_pb2_grpc

    config = load_config(federation.server_dir / "server.toml")
    config = replace(config, listen="127.0.0.1:0", state_dir=tmp_path / "state")
    server = daemon.CoordinatorServer(config, insecure=True)
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            response = stub.GetStatus(
                coordinator_pb2.StatusRequest(), metadata=[("x-afl-site-id", "x2")], timeout=10
            )
            assert response.site_id == "x2" and not response.enrolled
            with pytest.raises(grpc.RpcError) as info:
                stub.GetStatus(coordinator_pb2.StatusRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        server.stop(None)
    assert "NO TLS" in daemon.INSECURE_WARNING


def test_health_port_serves_the_health_service_alone_in_plaintext(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    """--health-port (Kubernetes gRPC probes speak no TLS): SERVING in plaintext there, NOT_SERVING
    after a stop begins, and the Coordinator service is not reachable through it."""
    from dataclasses import replace

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from afl.proto.v1 import coordinator_pb2_grpc

    config = load_config(federation.server_dir / "server.toml")
    config = replace(config, listen="127.0.0.1:0", state_dir=tmp_path / "state")
    server = daemon.CoordinatorServer(config, health_listen="127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=daemon.SERVICE_NAME), timeout=10
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as info:
                coordinator_pb2_grpc.CoordinatorStub(channel).GetStatus(
                    coordinator_pb2.StatusRequest(), timeout=10
                )
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(None)
    busy = daemon.CoordinatorServer(replace(config, state_dir=tmp_path / "s2"))
    try:
        with pytest.raises(ConfigError, match="cannot serve health checks"):
            daemon.CoordinatorServer(
                replace(config, listen="127.0.0.1:0", state_dir=tmp_path / "s3"),
                health_listen=f"127.0.0.1:{busy.port}",
            )
    finally:
        busy.stop(None)


def _loopback_server(federation: ProvisionedFederation, tmp_path: Path) -> daemon.CoordinatorServer:
    """A started coordinator of ``federation`` on a free loopback port, its state in tmp_path."""
    from dataclasses import replace

    config = load_config(federation.server_dir / "server.toml")
    server = daemon.CoordinatorServer(
        replace(config, listen="127.0.0.1:0", state_dir=tmp_path / "state")
    )
    server.start()
    return server


def test_wait_returns_only_once_the_stop_has_closed_the_store(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    """The daemon's main thread returns (and the interpreter exits) after ``wait``: it must not
    return while a stop is still shutting gRPC down and closing the store."""
    import threading

    server = _loopback_server(federation, tmp_path)
    closing, release = threading.Event(), threading.Event()
    close = server.store.close

    def slow_close() -> None:
        closing.set()
        release.wait(timeout=60)
        close()

    server.store.close = slow_close  # type: ignore[method-assign]
    stopper = threading.Thread(target=server.stop, args=(None,))
    waiter = threading.Thread(target=server.wait)
    stopper.start()
    try:
        assert closing.wait(timeout=60)  # the stop is under way, the store still open
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive(), "wait() returned before the stop had closed the store"
    finally:
        release.set()
        stopper.join(timeout=60)
    waiter.join(timeout=60)
    assert not waiter.is_alive()


def test_a_call_past_the_grace_period_finds_the_store_stopping_not_closed(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    """gRPC lets a handler run on after ``stop(grace)``: the store closes between the
    coordinator's locked sections, and a later call gets StoppingError (UNAVAILABLE, retried by
    sites), not sqlite3's closed-database error as an internal one with a traceback."""
    import threading

    server = _loopback_server(federation, tmp_path)
    site = next(iter(federation.site_dirs))
    stopper = threading.Thread(target=server.stop, args=(None,))
    with server.coordinator.lock:  # a handler inside a transition
        stopper.start()
        stopper.join(timeout=0.5)
        assert stopper.is_alive(), "the store closed while a locked section was running"
        assert server.store.enrolment(site) is None  # still open
    stopper.join(timeout=60)
    assert not stopper.is_alive()
    with pytest.raises(StoppingError, match="stopping"):
        server.coordinator.require_enrolled(site)
    with pytest.raises(StoppingError), server.store.transaction():
        pass
    with pytest.raises(StoppingError):
        server.store._db.cursor()  # any use of the closed connection, not only execute
    server.store.close()  # a second close does nothing (UNAVAILABLE: the mapping's own test)


def test_afl_server_process_stops_gracefully_on_sigterm(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    import signal
    import subprocess
    import sys

    state = tmp_path / "state"
    command = [
        sys.executable,
        "-m",
        "afl.server.daemon.main",
        "--config",
        str(federation.server_dir / "server.toml"),
        "--listen",
        "127.0.0.1:0",
    ]
    text = (federation.server_dir / "server.toml").read_text()
    config_copy = federation.server_dir / "server-test.toml"
    config_copy.write_text(text.replace('state_dir = "state"', f'state_dir = "{state}"'))
    command[4] = str(config_copy)
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        lines = []
        for line in process.stderr:
            lines.append(line)
            if "listening on port" in line:
                break
        assert any("listening on port" in line for line in lines), lines
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        rest = process.stderr.read()
        assert "afl-server stopped" in rest, rest  # the stop ran to its end before the exit
    finally:
        if process.poll() is None:
            process.kill()
        config_copy.unlink()
    assert (state / "server.sqlite3").is_file()
