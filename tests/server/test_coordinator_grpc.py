"""afl-server over loopback gRPC with real mutual TLS from a provisioned federation, driven by a
minimal fake site (tests/server/fakeclient.py): enrolment by certificate identity, the signed
plan, chunked and bad uploads, the solve against the in-process oracle, restart and resume."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from numpy.typing import NDArray
from prometheus_client import generate_latest

from afl.core.aggregation import GramScope, class_b_sums, federated_solve, plan_aggregation
from afl.core.refinement import RefinementParams, pseudo_label_projection, solve_round2
from afl.core.row_bounds import measure
from afl.core.stats import LocalStats, local_statistics
from afl.crypto.identity.signed_blobs import blob_sha256
from afl.crypto.transparency.checkpoint import Checkpoint, cosign
from afl.crypto.transparency.merkle import leaf_hash, verify_consistency, verify_inclusion
from afl.crypto.transparency.statements import plan_statement
from afl.ops.provisioning import ProvisionedFederation, provision
from afl.proto import wire
from afl.proto.v1 import common_pb2, coordinator_pb2
from afl.server import coordinator as coordinator_module
from afl.server.config import load_config
from afl.server.daemon.main import CoordinatorServer
from tests.helpers.federation import FederationSpec
from tests.helpers.numeric import relative_error
from tests.server import fakeclient
from tests.server.fakeclient import FakeSite, chunks, payload

SITES = ["s1", "s2", "s3", "s4"]
CLASSES = ["a", "b", "c"]
D = 16
GAMMA = 0.5
COVERAGE = {"s1": ["a", "b", "c"], "s2": ["a", "b"], "s3": ["b", "c"], "s4": ["a", "c"]}
Code = grpc.StatusCode
FEDERATION = FederationSpec(
    sites=[*SITES, "outsider"],
    federation_id="fed-t",
    round_settings={"classes": CLASSES, "feature_dim": D, "gamma": GAMMA, "min_participants": 3},
)


@pytest.fixture(scope="module")
def data() -> dict[str, tuple[NDArray[np.float64], NDArray[np.int64]]]:
    rng = np.random.default_rng(20240607)
    out = {}
    for k, site in enumerate(SITES):
        n = 30 + 5 * k
        features = rng.normal(size=(n, D)) + 0.3 * k
        labels = (rng.random((n, len(CLASSES))) < 0.4).astype(np.int64)
        labels[:2], labels[2:4] = 1, 0  # every labelled class has positives and negatives
        labels[:, [c not in COVERAGE[site] for c in CLASSES]] = -1
        out[site] = (features, labels)
    return out


@pytest.fixture(scope="module")
def stats(data: dict[str, tuple[NDArray[np.float64], NDArray[np.int64]]]) -> dict[str, LocalStats]:
    return {
        s: local_statistics(h, y, active=np.array([c in COVERAGE[s] for c in CLASSES]))
        for s, (h, y) in data.items()
    }


def server_key(federation: ProvisionedFederation) -> bytes:
    return load_config(federation.server_dir / "server.toml").identity_public_key


def start(
    federation: ProvisionedFederation, state: Path, **round_settings: Any
) -> CoordinatorServer:
    config = load_config(federation.server_dir / "server.toml")
    settings = {"participants": tuple(SITES), **round_settings}
    known = {s: e for s, e in config.sites.items() if s != "outsider"}  # CA-issued, unknown
    config = replace(
        config,
        listen="127.0.0.1:0",
        state_dir=state,
        sites=known,
        round=replace(config.round, **settings),
    )
    server = CoordinatorServer(config, tick_s=0.05)
    server.start()
    return server


@pytest.fixture
def make_server(
    federation: ProvisionedFederation, tmp_path: Path
) -> Iterator[Callable[..., CoordinatorServer]]:
    servers: list[CoordinatorServer] = []

    def make(**settings: Any) -> CoordinatorServer:
        servers.append(start(federation, tmp_path / "state", **settings))
        return servers[-1]

    yield make
    for server in servers:
        server.stop(None)


def connect(
    federation: ProvisionedFederation, port: int, names: list[str] = SITES
) -> dict[str, FakeSite]:
    return {s: FakeSite(s, federation.site_dirs[s], port) for s in names}


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def enrol_and_accept(sites: dict[str, FakeSite], key: bytes) -> tuple[Any, Any]:
    return fakeclient.enrol_and_accept(sites, key, coverage=COVERAGE, d=D)


@pytest.mark.parametrize("scope", ["global", "per-class"])
def test_round_solves_like_the_in_process_oracle(
    federation: ProvisionedFederation,
    make_server: Callable[..., CoordinatorServer],
    stats: dict[str, LocalStats],
    scope: GramScope,
) -> None:
    server = make_server(gram_scope=scope, operator_override=True, override_reason="test")
    key = server_key(federation)
    sites = connect(federation, server.port)
    config, plan = enrol_and_accept(sites, key)
    assert list(plan.participants) == SITES and plan.round_id == config.round_id
    for s, site in sites.items():
        for receipt in site.upload_all(config, plan, stats[s]):
            assert not receipt.duplicate
    model, weights = sites["s2"].model(key)
    oracle, _ = federated_solve([stats[s] for s in SITES], gamma=GAMMA, gram_scope=scope)
    assert weights.shape == (D, len(CLASSES))
    assert relative_error(weights, oracle) <= 1e-9
    assert list(model.class_names) == CLASSES and model.round_id == config.round_id
    assert list(model.contributors) == SITES
    status = sites["s1"].status()
    assert status.round.stage == coordinator_pb2.ROUND_STAGE_PUBLISHED
    assert status.latest_model_round_id == config.round_id
    if scope == "per-class":  # one Gram per distinct coverage set, b[c] over S_c
        members = {r.name: list(r.member_site_ids) for r in plan.releases}
        assert members["b[b]"] == ["s1", "s2", "s3"]
        assert sum(r.kind == common_pb2.STATISTIC_KIND_GRAM for r in plan.releases) == 3


def test_bad_uploads_get_the_right_status_and_the_round_completes(
    federation: ProvisionedFederation,
    make_server: Callable[..., CoordinatorServer],
    stats: dict[str, LocalStats],
) -> None:
    server = make_server()
    key = server_key(federation)
    sites = connect(federation, server.port)
    for s, site in sites.items():
        site.enroll(COVERAGE[s], D)
    s1 = sites["s1"]
    config = s1.config()
    plan = s1.verified_plan(config, key)
    gram = next(r for r in plan.releases if r.kind == common_pb2.STATISTIC_KIND_GRAM)
    good = payload(gram, stats["s1"], CLASSES)
    rid = config.round_id
    # Before accepting the plan: wrong stage for this site.
    assert code_of(lambda: s1.send(chunks(rid, gram.name, good))) == Code.FAILED_PRECONDITION
    for site in sites.values():
        site.decide(site.config(), accept=True)
    parts = chunks(rid, gram.name, good, size=256)
    assert len(parts) > 3
    bad_cases: list[tuple[list[coordinator_pb2.UploadChunk], grpc.StatusCode]] = [
        (parts[:-1], Code.INVALID_ARGUMENT),  # truncated
        ([parts[0], parts[0], *parts[1:]], Code.INVALID_ARGUMENT),  # duplicated chunk
        ([parts[1], parts[0], *parts[2:]], Code.INVALID_ARGUMENT),  # out of order
        (chunks(rid, gram.name, good, digest=b"\x00" * 32), Code.INVALID_ARGUMENT),  # digest
        (chunks(rid, gram.name, good[:-8]), Code.INVALID_ARGUMENT),  # wrong shape
        (chunks(rid, "gram[nope]", good), Code.INVALID_ARGUMENT),  # not in the plan
        (chunks("r1-0000", gram.name, good), Code.FAILED_PRECONDITION),  # wrong round
        (chunks(rid, gram.name, bytes(2 << 20), size=2 << 20), Code.RESOURCE_EXHAUSTED),  # chunk
        ([], Code.INVALID_ARGUMENT),  # empty stream
    ]
    for bad_value in (np.nan, np.inf, -np.inf):
        values = np.frombuffer(good, dtype="<f8").copy()
        values[3] = bad_value
        bad_cases.append((chunks(rid, gram.name, values.tobytes()), Code.INVALID_ARGUMENT))
    for bad, code in bad_cases:
        assert code_of(partial(s1.send, bad)) == code
    receipt = s1.send(parts)
    assert not receipt.duplicate and receipt.bytes_received == len(good)
    replay = s1.send(parts)  # retry of the same payload: same receipt, marked duplicate
    assert replay.duplicate and replay.sha256 == receipt.sha256
    other = np.frombuffer(good, dtype="<f8") + 1.0
    assert code_of(lambda: s1.send(chunks(rid, gram.name, other.tobytes()))) == Code.ALREADY_EXISTS
    for s, site in sites.items():
        site.upload_all(config, plan, stats[s]) if s != "s1" else None
    s1_rest = [r for r in plan.releases if r.name != gram.name]
    for r in s1_rest:
        s1.send(chunks(rid, r.name, payload(r, stats["s1"], CLASSES)))
    _, weights = s1.model(key)
    oracle, _ = federated_solve([stats[s] for s in SITES], gamma=GAMMA, gram_scope="global")
    assert relative_error(weights, oracle) <= 1e-9
    # After publication a retry is still idempotent.
    retry = chunks(rid, gram.name, payload(gram, stats["s2"], CLASSES))
    assert sites["s2"].send(retry).duplicate


def test_identity_checks(
    federation: ProvisionedFederation,
    make_server: Callable[..., CoordinatorServer],
    tmp_path: Path,
) -> None:
    server = make_server()
    sites = connect(federation, server.port)
    # Unenrolled: no round config, no uploads.
    assert code_of(lambda: sites["s1"].config()) == Code.PERMISSION_DENIED
    assert code_of(lambda: sites["s1"].send(chunks("x", "y", b"1" * 8))) == Code.PERMISSION_DENIED
    assert not sites["s1"].status().enrolled
    # A certificate of this CA for a site the server does not know.
    outsider = connect(federation, server.port, ["outsider"])["outsider"]
    assert code_of(lambda: outsider.status()) == Code.PERMISSION_DENIED
    # A certificate from another CA never gets past the TLS handshake.
    rogue = provision(tmp_path / "rogue", sites=["s1"]).site_dirs["s1"]
    foreign = FakeSite(
        "s1",
        federation.site_dirs["s1"],
        server.port,
        key_pem=(rogue / "site.key").read_bytes(),
        cert_pem=(rogue / "site.pem").read_bytes(),
    )
    assert code_of(lambda: foreign.status()) == Code.UNAVAILABLE
    # Enrolling with another site's identity key (valid proof, wrong key for this certificate).
    impostor = FakeSite("s1", federation.site_dirs["s1"], server.port)
    impostor.identity = sites["s2"].identity
    assert code_of(lambda: impostor.enroll(COVERAGE["s1"], D)) == Code.PERMISSION_DENIED
    # A site whose features do not fit the run (another d) enrols, but the run leaves it out
    # and its status says why; the other sites' round opens without it.
    sites["s1"].enroll(COVERAGE["s1"], D + 1)
    for s in ("s2", "s3"):
        sites[s].enroll(COVERAGE[s], D)
    wait_for(lambda: sites["s1"].status().note != "", "the note of the left-out site")
    status = sites["s1"].status()
    assert not status.HasField("round") and f"d = {D + 1}" in status.note


def test_plan_signature_and_health(
    federation: ProvisionedFederation, make_server: Callable[..., CoordinatorServer]
) -> None:
    server = make_server()
    key = server_key(federation)
    sites = connect(federation, server.port)
    config, plan = enrol_and_accept(sites, key)
    assert plan.aggregation == common_pb2.AGGREGATION_MODE_PLAINTEXT
    assert {r.name for r in plan.releases} == {"gram[all]", "b[a]", "b[b]", "b[c]"}
    assert all(list(r.member_site_ids) == SITES for r in plan.releases)
    tampered = coordinator_pb2.RoundConfig()
    tampered.CopyFrom(config)
    tampered.release_plan.plan = config.release_plan.plan + b"\x00"
    with pytest.raises(Exception, match="does not verify"):
        sites["s1"].verified_plan(tampered, key)
    health = health_pb2_grpc.HealthStub(sites["s1"].channel)
    response = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    assert sites["s1"].status().round.stage == coordinator_pb2.ROUND_STAGE_UPLOAD
    scraped = generate_latest(server.metrics.registry).decode()
    assert "afl_enrolments_total 4.0" in scraped
    # The stage by name: exactly the current one is 1 (docs/operations.md §13).
    assert 'afl_round_stage{afl_round_stage="UPLOAD"} 1.0' in scraped
    assert 'afl_round_stage{afl_round_stage="PLAN_REVIEW"} 0.0' in scraped


def test_restart_resumes_without_re_uploading(
    federation: ProvisionedFederation,
    make_server: Callable[..., CoordinatorServer],
    stats: dict[str, LocalStats],
) -> None:
    first = make_server()
    key = server_key(federation)
    sites = connect(federation, first.port)
    config, plan = enrol_and_accept(sites, key)
    for s in ("s1", "s2"):
        sites[s].upload_all(config, plan, stats[s])
    uploads_before = first.metrics.upload_bytes._value.get()
    assert uploads_before > 0
    first.stop(None)  # "kill" mid-round

    second = make_server()
    sites = connect(federation, second.port)
    status = sites["s1"].status()
    assert status.round.round_id == config.round_id
    assert status.round.stage == coordinator_pb2.ROUND_STAGE_UPLOAD
    assert sorted(status.round.caller_uploads_complete) == sorted(r.name for r in plan.releases)
    for s in ("s3", "s4"):  # only the missing sites upload; s1 and s2 send nothing
        sites[s].upload_all(config, plan, stats[s])
    _, weights = sites["s1"].model(key)
    oracle, _ = federated_solve([stats[s] for s in SITES], gamma=GAMMA, gram_scope="global")
    assert relative_error(weights, oracle) <= 1e-9
    assert second.metrics.uploads.labels(outcome="stored")._value.get() == 2 * len(plan.releases)
    assert second.store.verify_audit_chain()


def test_refusal_aborts_and_replans_without_the_refuser(
    federation: ProvisionedFederation,
    make_server: Callable[..., CoordinatorServer],
    stats: dict[str, LocalStats],
) -> None:
    server = make_server()
    key = server_key(federation)
    sites = connect(federation, server.port)
    for s, site in sites.items():
        site.enroll(COVERAGE[s], D)
    first = sites["s1"].config()
    sites["s4"].decide(sites["s4"].config(), accept=False, reason="min cohort")
    old = sites["s1"].status(first.round_id).round
    assert old.stage == coordinator_pb2.ROUND_STAGE_ABORTED and "s4" in old.abort_reason
    config = sites["s1"].config()
    assert config.round_id != first.round_id and list(config.participants) == SITES[:3]
    assert code_of(lambda: sites["s4"].config()) == Code.PERMISSION_DENIED
    plan = sites["s1"].verified_plan(config, key)
    for s in SITES[:3]:
        sites[s].decide(config, accept=True)
        sites[s].upload_all(config, plan, stats[s])
    _, weights = sites["s1"].model(key)
    oracle, _ = federated_solve([stats[s] for s in SITES[:3]], gamma=GAMMA, gram_scope="global")
    assert relative_error(weights, oracle) <= 1e-9


def test_upload_timeout_replans_with_the_sites_that_finished(
    federation: ProvisionedFederation,
    make_server: Callable[..., CoordinatorServer],
    stats: dict[str, LocalStats],
) -> None:
    server = make_server(upload_timeout_s=1.0)
    key = server_key(federation)
    sites = connect(federation, server.port)
    config, plan = enrol_and_accept(sites, key)
    for s in SITES[:3]:
        sites[s].upload_all(config, plan, stats[s])
    wait_for(lambda: sites["s1"].config().round_id != config.round_id, "the replacement round")
    old = sites["s1"].status(config.round_id).round
    assert old.stage == coordinator_pb2.ROUND_STAGE_ABORTED and "s4" in old.abort_reason
    new = sites["s1"].config()
    assert list(new.participants) == SITES[:3]
    new_plan = sites["s1"].verified_plan(new, key)
    for s in SITES[:3]:
        sites[s].decide(new, accept=True)
        sites[s].upload_all(new, new_plan, stats[s])
    _, weights = sites["s1"].model(key, new.round_id)
    oracle, _ = federated_solve([stats[s] for s in SITES[:3]], gamma=GAMMA, gram_scope="global")
    assert relative_error(weights, oracle) <= 1e-9


def test_round_two_matches_the_refinement_oracle(
    federation: ProvisionedFederation,
    make_server: Callable[..., CoordinatorServer],
    stats: dict[str, LocalStats],
    data: dict[str, tuple[NDArray[np.float64], NDArray[np.int64]]],
) -> None:
    params = RefinementParams(tau=0.5, alpha=0.5, delta_pos=1, delta_neg=1)
    server = make_server(rounds=2, refinement=params)
    key = server_key(federation)
    sites = connect(federation, server.port)
    config, plan = enrol_and_accept(sites, key)
    for s, site in sites.items():
        site.upload_all(config, plan, stats[s])
    _, w1 = sites["s1"].model(key, config.round_id)
    config2 = sites["s1"].config()
    assert config2.round_number == 2 and config2.parent_round_id == config.round_id
    assert config2.refinement.tau == pytest.approx(0.5)
    plan2 = sites["s1"].verified_plan(config2, key)
    pseudo = {}
    for s, site in sites.items():
        missing = np.array([c not in COVERAGE[s] for c in CLASSES])
        pseudo[s] = pseudo_label_projection(data[s][0], weights=w1, missing=missing, params=params)
        site.decide(config2, accept=True)
        for r in plan2.releases:
            column = pseudo[s].b[:, [CLASSES.index(r.class_names[0])]]
            site.send(
                chunks(config2.round_id, r.name, np.ascontiguousarray(column, "<f8").tobytes())
            )
    model2, w2 = sites["s1"].model(key)
    assert model2.round_id == config2.round_id and model2.round_number == 2
    everything = [stats[s] for s in SITES]
    agg = plan_aggregation(np.stack([x.contributes for x in everything]), gram_scope="global")
    oracle = solve_round2(
        gram_total=sum((x.gram for x in everything), np.zeros((D, D))),
        b_real=class_b_sums(agg, [x.b for x in everything]),
        b_pseudo=sum((pseudo[s].b for s in SITES), np.zeros((D, len(CLASSES)))),
        alpha=params.alpha,
        gamma=GAMMA,
    )
    assert relative_error(w2, oracle) <= 1e-9
    assert any(p.contributes.any() for p in pseudo.values())
    assert relative_error(w2, w1) > 1e-6  # round 2 changed something


def test_watch_rounds_streams_stage_changes(
    federation: ProvisionedFederation, make_server: Callable[..., CoordinatorServer]
) -> None:
    server = make_server()
    sites = connect(federation, server.port)
    for s, site in sites.items():
        site.enroll(COVERAGE[s], D)
    stream = sites["s1"].stub.WatchRounds(coordinator_pb2.WatchRequest(), timeout=10)
    stages = []
    for event in stream:
        stages.append(event.status.stage)
        if event.status.stage == coordinator_pb2.ROUND_STAGE_PLAN_REVIEW:
            stream.cancel()
            break
    assert coordinator_pb2.ROUND_STAGE_PLAN_REVIEW in stages


def test_a_plaintext_upload_no_dataset_of_the_declared_size_could_produce_is_refused(
    federation: ProvisionedFederation,
    make_server: Callable[..., CoordinatorServer],
    data: dict[str, tuple[NDArray[np.float64], NDArray[np.int64]]],
    stats: dict[str, LocalStats],
) -> None:
    """Bounded influence in plaintext (docs/protocol.md §6.2, M-134): the coordinator refuses a
    class vector longer than 2L (the in-bound mask attack −sign(b)·0.99·2L per entry) and a Gram
    whose trace exceeds N·L², for the N and L the site declared; honest uploads pass and the
    round completes."""
    server = make_server()
    key = server_key(federation)
    sites = connect(federation, server.port)
    declared = {s: measure(h).declared() for s, (h, _) in data.items()}
    for s, site in sites.items():
        bounds = declared[s]
        site.enroll(
            COVERAGE[s], D, declared_rows=bounds.rows, declared_max_row_norm=bounds.max_row_norm
        )
    config = sites["s1"].config()
    plan = sites["s1"].verified_plan(config, key)
    for site in sites.values():
        site.decide(site.config(), accept=True)
    rid, bound = config.round_id, declared["s1"]
    vector = next(
        r for r in plan.releases
        if r.kind == common_pb2.STATISTIC_KIND_CLASS_VECTOR and "s1" in r.member_site_ids
    )  # fmt: skip
    honest = np.frombuffer(payload(vector, stats["s1"], CLASSES), dtype="<f8")
    attack = -np.sign(honest) * 0.99 * bound.vector_bound  # within mask's per-entry bound
    with pytest.raises(grpc.RpcError) as info:
        sites["s1"].send(chunks(rid, vector.upload_name, attack.tobytes()))
    assert info.value.code() == Code.INVALID_ARGUMENT
    assert "class vector norm above 2L" in str(info.value.details())
    gram = next(r for r in plan.releases if r.kind == common_pb2.STATISTIC_KIND_GRAM)
    inflated = np.frombuffer(payload(gram, stats["s1"], CLASSES), dtype="<f8") * (
        1.01 * bound.gram_bound / np.trace(stats["s1"].gram)
    )
    with pytest.raises(grpc.RpcError) as info:
        sites["s1"].send(chunks(rid, gram.upload_name, inflated.tobytes()))
    assert info.value.code() == Code.INVALID_ARGUMENT
    assert "Gram trace" in str(info.value.details())
    for s, site in sites.items():
        site.upload_all(config, plan, stats[s])
    _, weights = sites["s1"].model(key)
    assert np.isfinite(weights).all()


def test_one_checkpoint_call_carries_a_witness_s_proofs(
    federation: ProvisionedFederation, make_server: Callable[..., CoordinatorServer]
) -> None:
    """GetCheckpoint over TLS answers the consistency proof from the caller's last cosigned size,
    the plan's inclusion proof (and a second statement's, asked for) and, asked for, the log's
    statements from the caller's prefix up to the checkpoint, as GetLogEntries serves them
    (docs/protocol.md §11a), CosignCheckpoint the cosignatures held once the caller's is kept;
    a size above the asked checkpoint's is INVALID_ARGUMENT naming both sizes."""
    server = make_server()
    sites = connect(federation, server.port)
    config, _ = enrol_and_accept(sites, server_key(federation))
    stub = sites["s1"].stub
    plan = plan_statement(
        federation=federation.federation_id,
        round_id=config.round_id,
        plan_sha256=blob_sha256(config.release_plan.plan),
    )
    request = coordinator_pb2.CheckpointRequest(consistency_from=1, inclusion_leaf=leaf_hash(plan))
    answer = stub.GetCheckpoint(request, timeout=10)
    size, root = int(answer.checkpoint.size), bytes(answer.checkpoint.root)
    (first,) = stub.GetLogEntries(coordinator_pb2.LogEntriesRequest(start=0, end=1)).entries
    assert size > 1  # the enrolments, the run and the plan
    verify_consistency(
        old_size=1, new_size=size, old_root=leaf_hash(first.statement), new_root=root,
        proof=list(answer.consistency),
    )  # fmt: skip
    verify_inclusion(
        leaf=leaf_hash(plan), index=int(answer.inclusion.index), tree_size=size,
        proof=list(answer.inclusion.hashes), root=root,
    )  # fmt: skip
    assert not answer.entries and not answer.HasField("also_inclusion")  # none asked for
    both = stub.GetCheckpoint(
        coordinator_pb2.CheckpointRequest(
            inclusion_leaf=leaf_hash(plan), also_leaf=leaf_hash(first.statement)
        ),
        timeout=10,
    )
    assert both.inclusion == answer.inclusion and both.also_inclusion.index == 0
    verify_inclusion(
        leaf=leaf_hash(first.statement), index=0, tree_size=size,
        proof=list(both.also_inclusion.hashes), root=root,
    )  # fmt: skip
    served = stub.GetLogEntries(coordinator_pb2.LogEntriesRequest(start=1, end=size)).entries
    for start, want in ((1, list(served)), (0, [first, *served]), (size, [])):
        carried = stub.GetCheckpoint(
            coordinator_pb2.CheckpointRequest(with_entries=True, entries_from=start), timeout=10
        )
        assert carried.checkpoint == answer.checkpoint and list(carried.entries) == want, start
    # The cosignature's answer: the checkpoint with the cosignatures now held, the caller's.
    mine = cosign(
        sites["s1"].identity,
        witness="s1",
        checkpoint=Checkpoint(federation.federation_id, size, root),
    )
    held = stub.CosignCheckpoint(wire.cosignature_to_proto(mine), timeout=10)
    assert held.checkpoint == answer.checkpoint
    assert [c.witness for c in held.cosignatures] == ["s1"]
    too_far = coordinator_pb2.CheckpointRequest(size=size, consistency_from=size + 1)
    with pytest.raises(grpc.RpcError) as info:
        stub.GetCheckpoint(too_far, timeout=10)
    assert info.value.code() == Code.INVALID_ARGUMENT
    assert f"from size {size + 1} to the checkpoint of size {size}" in str(info.value.details())


def test_a_held_checkpoint_call_answers_when_the_cosignature_it_waits_for_is_kept(
    federation: ProvisionedFederation,
    make_server: Callable[..., CoordinatorServer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GetCheckpoint with ``wait_ms`` and ``wait_cosignatures`` over TLS is held until a
    cosignature gives its checkpoint that many (docs/protocol.md §11a, M-236): the hold here
    could last two minutes, so a call that returns within the test's 30 s was woken by the
    cosignature. The caller's second held call is answered at once (one per caller), a wait for
    growth with a ``size`` is INVALID_ARGUMENT, and a stopping server answers a held call
    within its grace period."""
    monkeypatch.setattr(coordinator_module, "CHECKPOINT_HOLD_MAX_S", 120.0)
    server = make_server()
    sites = connect(federation, server.port)
    enrol_and_accept(sites, server_key(federation))
    s1, s2 = sites["s1"].stub, sites["s2"].stub
    answer = s1.GetCheckpoint(coordinator_pb2.CheckpointRequest(), timeout=10)
    hold = coordinator_pb2.CheckpointRequest(
        wait_ms=120_000, wait_cosignatures=1, with_entries=True, entries_from=1
    )
    held = s1.GetCheckpoint.future(hold, timeout=60)
    deadline = time.monotonic() + 30
    while "s1" not in server.coordinator._holding and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "s1" in server.coordinator._holding and not held.done()
    second = s1.GetCheckpoint(hold, timeout=30)  # a second hold would outlast this deadline
    assert second.checkpoint == answer.checkpoint and not second.cosignatures
    checkpoint = Checkpoint(
        federation.federation_id, int(answer.checkpoint.size), bytes(answer.checkpoint.root)
    )
    mine = cosign(sites["s2"].identity, witness="s2", checkpoint=checkpoint)
    s2.CosignCheckpoint(wire.cosignature_to_proto(mine), timeout=10)
    woken = held.result(timeout=30)
    assert woken.checkpoint == answer.checkpoint
    assert [c.witness for c in woken.cosignatures] == ["s2"]
    assert [e.index for e in woken.entries] == list(range(1, int(answer.checkpoint.size)))
    assert "s1" not in server.coordinator._holding
    growth_of_a_size = coordinator_pb2.CheckpointRequest(
        size=int(answer.checkpoint.size), wait_ms=1000, wait_grown_past=1
    )
    assert code_of(lambda: s1.GetCheckpoint(growth_of_a_size, timeout=10)) == Code.INVALID_ARGUMENT
    # Held for growth past the newest size: the stop answers it (within the 2 s grace period).
    grown = coordinator_pb2.CheckpointRequest(
        wait_ms=120_000, wait_grown_past=int(answer.checkpoint.size)
    )
    held = s2.GetCheckpoint.future(grown, timeout=60)
    deadline = time.monotonic() + 30
    while "s2" not in server.coordinator._holding and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "s2" in server.coordinator._holding and not held.done()
    server.stop()
    assert held.result(timeout=30).checkpoint == answer.checkpoint


def test_a_hold_ends_at_the_coordinator_s_cap_and_a_full_pool_holds_nothing(
    federation: ProvisionedFederation,
    make_server: Callable[..., CoordinatorServer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """However long a site asks to be held, the coordinator answers at its cap (M-236: 2 s,
    here 0.2 s; a hold of the two minutes asked would outlast the test's 30 s deadline), and
    with no thread to spare for a hold it answers at once."""
    monkeypatch.setattr(coordinator_module, "CHECKPOINT_HOLD_MAX_S", 0.2)
    server = make_server()
    sites = connect(federation, server.port)
    enrol_and_accept(sites, server_key(federation))
    forever = coordinator_pb2.CheckpointRequest(wait_ms=120_000, wait_cosignatures=99)
    answer = sites["s1"].stub.GetCheckpoint(forever, timeout=30)
    assert answer.checkpoint.size > 0 and len(answer.cosignatures) < 99
    monkeypatch.setattr(coordinator_module, "CHECKPOINT_HOLD_MAX_S", 120.0)
    server.coordinator._max_holding = 0  # as [limits] worker_threads = 10 leaves it
    assert sites["s1"].stub.GetCheckpoint(forever, timeout=30).checkpoint == answer.checkpoint
    assert not server.coordinator._holding
