"""What a coordinator's operator meets at start-up and when sites join (docs/operations.md): ports
in use and unknown config keys refused in one line, `afl-server check` and `status`, enrolment
checking the weights digest and the random-init stamp, classes outside the federation ignored
with a note, masked plans bounded by the sites' declared row bounds, and site failure reasons in
the log and the audit log. Driven over real mutual TLS by the fake site of tests/server."""

from __future__ import annotations

import logging
import socket
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from afl.core.row_bounds import RowBounds
from afl.ops.provisioning import ProvisionedFederation, provision
from afl.proto.v1 import common_pb2, coordinator_pb2
from afl.server import toml_text
from afl.server.config import MaskSettings, load_config
from afl.server.daemon.main import CoordinatorServer
from afl.server.daemon.main import main as server_main
from afl.server.errors import ConfigError
from afl.server.store import Store
from tests.helpers.federation import FederationSpec
from tests.server.fakeclient import FakeSite

SITES = ["s1", "s2", "s3"]
CLASSES = ["Atelectasis", "Effusion", "Mass"]
D = 8
DIGEST = "ab" * 32
FEDERATION = FederationSpec(
    sites=SITES,
    federation_id="fed-onboard",
    round_settings={"classes": CLASSES, "feature_dim": D},
)


def _config(federation: ProvisionedFederation, state: Path, **round_settings: Any) -> Any:
    config = load_config(federation.server_dir / "server.toml")
    return replace(
        config,
        listen="127.0.0.1:0",
        state_dir=state,
        round=replace(config.round, **round_settings),
    )


@pytest.fixture
def serve(
    federation: ProvisionedFederation, tmp_path: Path
) -> Iterator[Callable[..., tuple[CoordinatorServer, dict[str, FakeSite]]]]:
    servers: list[CoordinatorServer] = []

    def start(**round_settings: Any) -> tuple[CoordinatorServer, dict[str, FakeSite]]:
        server = CoordinatorServer(_config(federation, tmp_path / "state", **round_settings))
        server.start()
        servers.append(server)
        return server, {s: FakeSite(s, federation.site_dirs[s], server.port) for s in SITES}

    yield start
    for server in servers:
        server.stop(None)


def _code(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _toml(federation: ProvisionedFederation, tmp_path: Path, **changes: Any) -> Path:
    """server.toml with ``changes`` ({"table.key": value}, {"sites.s1.key": value}) applied."""
    doc = tomllib.loads((federation.server_dir / "server.toml").read_text(encoding="utf-8"))
    for dotted, value in changes.items():
        *tables, key = dotted.split(".")
        table = doc
        for name in tables:
            table = table.setdefault(name, {})
        table[key] = value
    path = federation.server_dir / f"{tmp_path.name}.toml"
    path.write_text(toml_text.dumps(doc), encoding="utf-8")
    return path


# --- start-up -----------------------------------------------------------------------------------


def test_a_port_in_use_is_refused_in_one_line_before_any_state(
    federation: ProvisionedFederation, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = _config(federation, tmp_path / "state")
        with pytest.raises(ConfigError, match=rf"cannot listen on 127.0.0.1:{port}: .*in use"):
            CoordinatorServer(replace(config, listen=f"127.0.0.1:{port}"))
        path = _toml(federation, tmp_path, **{"server.state_dir": str(tmp_path / "cli-state")})
        assert server_main(["--config", str(path), "--listen", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already in use" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "state").exists() and not (tmp_path / "cli-state").exists()


def test_a_second_server_on_the_same_port_fails(
    serve: Callable[..., tuple[CoordinatorServer, dict[str, FakeSite]]],
    federation: ProvisionedFederation,
    tmp_path: Path,
) -> None:
    first, _ = serve()
    config = _config(federation, tmp_path / "other")
    with pytest.raises(ConfigError, match="in use"):
        CoordinatorServer(replace(config, listen=f"127.0.0.1:{first.port}"))


def test_a_busy_metrics_port_is_one_line_and_creates_no_round(
    federation: ProvisionedFederation, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    path = _toml(federation, tmp_path, **{"server.state_dir": str(state)})
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        argv = ["--config", str(path), "--listen", "127.0.0.1:0", "--metrics-port", str(busy)]
        assert server_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot serve metrics on 127.0.0.1:{busy}" in err[0]
    assert not (state / "server.sqlite3").exists()  # no round was created


def test_metrics_address_is_configurable(federation: ProvisionedFederation, tmp_path: Path) -> None:
    path = _toml(federation, tmp_path, **{"server.metrics_address": "0.0.0.0"})
    assert load_config(path).metrics_address == "0.0.0.0"
    assert load_config(federation.server_dir / "server.toml").metrics_address == "127.0.0.1"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"round.mask_feature_nrom": 1.0},
            r"\[round\] mask_feature_nrom: unknown key \(did you mean 'mask_feature_norm'\?\)",
        ),
        (
            {"server.metrics_prot": 9100},
            r"\[server\] metrics_prot: unknown key \(did you mean 'metrics_port'\?\)",
        ),
        ({"rounds": {"gamma": 1.0}}, r"unknown table \[rounds\] \(did you mean 'round'\?\)"),
        (
            {"sites.s1.rol": "participant"},
            r"\[sites.s1\] rol: unknown key \(did you mean 'role'\?\)",
        ),
        ({"round.backbone_sha256": "xyz"}, "backbone_sha256: must be 64 hex digits"),
    ],
)
def test_unknown_keys_and_tables_are_refused_with_a_hint(
    federation: ProvisionedFederation, tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_toml(federation, tmp_path, **changes))


def test_two_sites_provision_a_loadable_federation(tmp_path: Path) -> None:
    fed = provision(
        tmp_path / "two", sites=["a", "b"], round_settings={"classes": ["x"], "feature_dim": 2}
    )
    assert load_config(fed.server_dir / "server.toml").round.min_participants == 2
    data = tomllib.loads((fed.site_dirs["a"] / "client.toml").read_text())["data"]
    assert data == {"cache": "cache", "classes": []}  # the key the docs name


# --- check and status -------------------------------------------------------------------------


def test_check_passes_on_a_fresh_kit_and_names_each_problem(
    federation: ProvisionedFederation, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as probe:  # a port free now (the provisioned 50051 may be taken here)
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    state = {
        "server.state_dir": str(tmp_path / "state"),
        "server.listen": f"127.0.0.1:{free}",
        "round.backbone": "xrv-densenet121-all",
    }
    path = _toml(federation, tmp_path, **state)
    assert server_main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ready to start" in out and "PROBLEM" not in out
    assert "is issued by" in out and "no state yet" in out and "is free" in out
    assert "WARNING backbone xrv-densenet121-all, weights NOT pinned" in out  # not a problem
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        other = provision(tmp_path / "other", sites=SITES)
        busy = _toml(
            federation,
            tmp_path,
            **{
                "server.listen": f"127.0.0.1:{port}",
                "tls.cert": str(other.server_dir / "server.pem"),
            },
        )
        assert server_main(["check", "--config", str(busy)]) == 1
    out = capsys.readouterr().out
    assert f"PROBLEM gRPC listen address 127.0.0.1:{port}: the address is already in use" in out
    assert "NOT issued by the CA" in out and "does NOT belong" in out  # foreign cert, key mismatch
    assert "3 problem(s) found" in out
    assert server_main(["check", "--config", str(tmp_path / "missing.toml")]) == 2


def test_status_shows_enrolment_round_and_the_last_error(
    serve: Callable[..., tuple[CoordinatorServer, dict[str, FakeSite]]],
    federation: ProvisionedFederation,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _toml(federation, tmp_path, **{"server.state_dir": str(tmp_path / "state")})
    assert server_main(["status", "--config", str(path)]) == 2
    assert "no server state yet" in capsys.readouterr().err
    _, sites = serve()
    sites["s1"].enroll(CLASSES, D)
    assert server_main(["status", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "s1" in out and "enrolled (participant)" in out and "s2" in out and "NOT enrolled" in out
    assert "enrolled (participant); labels 3 class(es)" in out  # s1 disclosed its coverage
    assert "WAITING_FOR_PARTICIPANTS; stage deadline" in out and "last error: none" in out
    for name in ("s2", "s3"):
        sites[name].enroll(CLASSES, D)
    config = sites["s1"].config()
    sites["s1"].stub.SubmitReport(
        coordinator_pb2.ClientReport(
            round_id=config.round_id,
            outcome=coordinator_pb2.CLIENT_OUTCOME_FAILED,
            reason="release gram[all]: set [round] mask_gram_bound = 1024 or more",
        ),
        timeout=10,
    )
    assert server_main(["status", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "PLAN_REVIEW" in out
    assert "last error: s1 reported FAILED: release gram[all]: set [round] mask_gram_bound" in out


# --- enrolment ----------------------------------------------------------------------------------


def _left_out(site: FakeSite) -> str:
    """The note of a site the current run leaves out (waits for the server to decide)."""
    deadline = time.monotonic() + 60
    while not (note := site.status().note):
        assert time.monotonic() < deadline, "the run never decided on the site"
        time.sleep(0.05)
    assert not site.status().HasField("round")
    return note


def test_random_init_features_are_refused_unless_the_federation_is_a_test(
    serve: Callable[..., tuple[CoordinatorServer, dict[str, FakeSite]]],
) -> None:
    """A run leaves out a site with random-init features (the site enrols: a later run may be a
    test) and tells it why."""
    _, sites = serve()
    sites["s1"].enroll(CLASSES, D, random_init=True)
    note = _left_out(sites["s1"])
    assert "RANDOM-INIT" in note and "allow_random_init" in note


def test_random_init_joins_a_test_federation(
    serve: Callable[..., tuple[CoordinatorServer, dict[str, FakeSite]]],
) -> None:
    _, sites = serve(allow_random_init=True)
    assert sites["s1"].enroll(CLASSES, D, random_init=True).site_id == "s1"


def test_the_pinned_weights_digest_is_enforced(
    serve: Callable[..., tuple[CoordinatorServer, dict[str, FakeSite]]],
) -> None:
    _, sites = serve(backbone_sha256=DIGEST)
    sites["s1"].enroll(CLASSES, D, weights_sha256="cd" * 32)
    sites["s2"].enroll(CLASSES, D)
    sites["s3"].enroll(CLASSES, D, weights_sha256=DIGEST.upper())
    assert f"pins weights sha256 {DIGEST}" in _left_out(sites["s1"])
    assert f"the site declared {'cd' * 32}" in _left_out(sites["s1"])
    assert "no digest" in _left_out(sites["s2"])
    assert sites["s3"].status().note == ""


def test_classes_outside_the_federation_are_kept_with_a_note(
    serve: Callable[..., tuple[CoordinatorServer, dict[str, FakeSite]]], tmp_path: Path
) -> None:
    server, sites = serve()
    reply = sites["s1"].enroll(["Atelectasis", "Efusion", "Hernia"], D)
    assert "classes not in server.toml's [round] classes" in reply.message
    assert "'Efusion' (did you mean 'Effusion'?)" in reply.message and "'Hernia'" in reply.message
    row = server.store.enrolments()["s1"]  # kept: a later run may use them; plans use the run's
    assert row.labelled_classes == ("Atelectasis", "Efusion", "Hernia")


# --- masked plans from declared bounds ------------------------------------------------------------


def test_masked_plan_bounds_come_from_the_declarations(
    serve: Callable[..., tuple[CoordinatorServer, dict[str, FakeSite]]],
    federation: ProvisionedFederation,
) -> None:
    key = load_config(federation.server_dir / "server.toml").identity_public_key
    server, sites = serve(aggregation="mask", mask=_no_bounds())
    declared = {"s1": (40, 3.0), "s2": (1000, 0.7), "s3": (5, 20.0)}  # rows, largest norm
    for name, (rows, norm) in declared.items():
        sites[name].enroll(CLASSES, D, declared_rows=rows, declared_max_row_norm=norm)
    stored = server.store.enrolments()
    # The coordinator keeps powers of two, whatever a site sends.
    assert stored["s1"].row_bounds == RowBounds(64, 4.0)
    assert stored["s2"].row_bounds == RowBounds(1024, 1.0)
    plan = sites["s1"].verified_plan(sites["s1"].config(), key)
    expect_gram = max(64 * 4.0**2, 1024 * 1.0**2, 8 * 32.0**2)
    for release in plan.releases:
        fp = release.encoding.fixed_point
        if release.kind == common_pb2.STATISTIC_KIND_GRAM:
            assert fp.bound == expect_gram
        else:
            assert fp.bound == 2 * 32.0


def test_a_site_without_declaration_aborts_the_masked_plan_with_its_name(
    serve: Callable[..., tuple[CoordinatorServer, dict[str, FakeSite]]],
) -> None:
    _, sites = serve(aggregation="mask", mask=_no_bounds())
    sites["s1"].enroll(CLASSES, D, declared_rows=10, declared_max_row_norm=1.0)
    sites["s2"].enroll(CLASSES, D, declared_rows=10, declared_max_row_norm=1.0)
    sites["s3"].enroll(CLASSES, D)  # e.g. [policy] disclose_row_bounds = false
    status = sites["s1"].status().round
    assert status.stage == coordinator_pb2.ROUND_STAGE_ABORTED
    assert "s3 declared none at enrolment" in status.abort_reason
    assert "mask_feature_norm and mask_max_samples" in status.abort_reason


def _no_bounds() -> MaskSettings:
    """[round] with aggregation = "mask" and every mask_* bound left at 0."""
    return MaskSettings()


# --- failure reasons ------------------------------------------------------------------------------


def test_a_sites_failure_reason_reaches_the_log_and_the_audit_log(
    serve: Callable[..., tuple[CoordinatorServer, dict[str, FakeSite]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, sites = serve()
    for name in SITES:
        sites[name].enroll(CLASSES, D)
    round_id = sites["s1"].config().round_id
    reason = (
        "release gram[all]: a value exceeds the plan's bound 1e+08 (it needs up to 5.36871e+08)"
    )
    caplog.set_level(logging.WARNING, logger="afl.server.coordinator")
    sites["s2"].stub.SubmitReport(
        coordinator_pb2.ClientReport(
            round_id=round_id, outcome=coordinator_pb2.CLIENT_OUTCOME_FAILED, reason=reason
        ),
        timeout=10,
    )
    assert any(reason in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    reports = [d for _, e, d, _, _ in server.store.audit_entries() if e == "client-report"]
    assert reports[-1]["reason"] == reason and reports[-1]["outcome"] == "CLIENT_OUTCOME_FAILED"
    assert reports[-1]["site_id"] == "s2"
    # The state read back by `afl-server status` (read-only) agrees.
    store = Store(server.store.state_dir, federation_id="fed-onboard", read_only=True)
    try:
        assert set(store.reports(round_id)) == {"s2"}
    finally:
        store.close()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--version"], ["check", "--version"]):
        with pytest.raises(SystemExit) as exc:
            server_main(argv)
        assert exc.value.code == 0 and capsys.readouterr().out.startswith("afl-server ")
