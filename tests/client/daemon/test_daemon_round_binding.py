"""What a site binds a round to, whatever the coordinator says (docs/protocol.md §2, §6, §7, §8):
the round ids it uses in file names, the round a RoundConfig is for, one plan per round id, and
the round 1 a DP round 2 composes with.

The site daemon runs unmodified against a malicious coordinator played by :class:`Coordinator`
(what the daemon's :class:`~afl.client.daemon.rpc.CoordinatorClient` would return; plans and
models are signed with the federation server's own key, which the coordinator holds)."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afl.client.config import DataConfig, LocalPolicy, load_client_config
from afl.client.daemon.loop import ClientDaemon, RoundFailed, witness_key
from afl.client.daemon.report import RoundReport
from afl.client.daemon.transport import DaemonError
from afl.client.model.evaluate import evaluate_model, write_local_evaluation
from afl.client.model.published import ModelFileError
from afl.client.modes.ckks import ZeroFiller
from afl.core.data.featurecache import CacheMeta, write_cache
from afl.crypto.identity import signatures
from afl.crypto.identity.signed_blobs import PLAN_CONTEXT, sign_blob
from afl.crypto.transparency.statements import roster_digest
from afl.ops.provisioning import ProvisionedFederation
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import load_config
from afl.server.plan.dp import DpSettings, apply_dp, calibrate, dp_releases
from afl.server.plan.release import PlannedRelease, build_plan, sign_plan
from afl.server.solve.model import build_signed_model
from tests.helpers.federation import FederationSpec
from tests.helpers.fedlog import LOG_RPCS, LogService

SITES = ("s1", "s2", "s3", "s4")
SITE = "s4"
CLASSES = ("A", "B")
D = 4
FED = "fed-round-binding"
FEDERATION = FederationSpec(
    sites=list(SITES),
    federation_id=FED,
    round_settings={"classes": list(CLASSES), "feature_dim": D},
)


def _gram(name: str, members: Sequence[str]) -> PlannedRelease:
    return PlannedRelease(name, tuple(members), cpb.STATISTIC_KIND_GRAM, (), (D, D))


def _b(cls: str, members: Sequence[str] = SITES) -> PlannedRelease:
    return PlannedRelease(
        f"b[{cls}]", tuple(members), cpb.STATISTIC_KIND_CLASS_VECTOR, (cls,), (D, 1)
    )


GLOBAL = [_gram("gram[all]", SITES), _b("A"), _b("B")]
# With GLOBAL's gram[all] in the site's history, gram{s1,s2,s3} determines G_s4 by differencing.
DIFFERENCING = [_gram("gram{s1,s2,s3}", SITES[:3]), _b("A"), _b("B")]


class Coordinator:
    """The coordinator as the site's RPC client sees it: rounds announced in ``rounds`` (status,
    config), every call recorded; uploads are acknowledged and models signed for any round."""

    watcher = None

    def __init__(self, server_key: Any, log_state: Path, roster_sha256: bytes = b"") -> None:
        self.server_key = server_key
        self.roster_sha256 = roster_sha256  # the digest every plan binds (M-221)
        self.log = LogService(log_state, key=server_key, federation_id=FED)  # an honest log
        self.log.caller = SITE
        self.rounds: list[tuple[pb.RoundStatus, pb.RoundConfig]] = []
        self.calls: list[tuple[str, Any]] = []
        self.uploads: list[tuple[str, str]] = []

    def announce(self, round_id: str, cfg: pb.RoundConfig) -> pb.RoundStatus:
        status = pb.RoundStatus(
            round_id=round_id, stage=pb.ROUND_STAGE_PLAN_REVIEW, participants=list(SITES)
        )
        self.rounds.append((status, cfg))
        return status

    def config(self, round_id: str) -> pb.RoundConfig:
        return next(cfg for status, cfg in self.rounds if status.round_id == round_id)

    def wait_for_round(self, done: set[str], **kw: Any) -> pb.RoundStatus | None:
        return next((s for s, _ in self.rounds if s.round_id not in done), None)

    def call(self, what: str, request: Any, **kw: Any) -> Any:
        self.calls.append((what, request))
        if what in LOG_RPCS:
            return self.log.call(what, request)
        if what == "GetRoundConfig":
            return self.config(request.round_id)
        if what == "GetModel":
            cfg = self.config(request.round_id)
            return build_signed_model(
                np.zeros((D, len(CLASSES))), identity_key=self.server_key, federation_id=FED,
                round_id=request.round_id, round_number=cfg.round_number, classes=CLASSES, gamma=1.0, backbone="test",
                contributors=SITES, plan_bytes=cfg.release_plan.plan,
            )  # fmt: skip
        if what in ("RespondToPlan", "SubmitReport"):
            return cpb.Ack()
        raise AssertionError(f"unexpected call {what}")

    def await_stage(
        self, round_id: str, *, at_least: int, stage_only: bool = False
    ) -> pb.RoundStatus:
        stage: Any = at_least
        if at_least == pb.ROUND_STAGE_PUBLISHED:  # its release is in the log (M-230), as the
            cfg = self.config(round_id)  # coordinator logs it in the PUBLISHED transition
            self.log.publish_release(round_id, cfg.release_plan.plan, survivors=SITES)
        return pb.RoundStatus(round_id=round_id, stage=stage, participants=list(SITES))

    def upload(self, data: bytes, *, round_id: str, release_name: str, **kw: Any) -> Any:
        self.uploads.append((round_id, release_name))
        return pb.UploadReceipt(round_id=round_id, release_name=release_name)

    def decisions(self) -> list[pb.PlanDecision]:
        return [r for what, r in self.calls if what == "RespondToPlan"]

    def round_config(
        self,
        round_id: str,
        releases: Sequence[PlannedRelease],
        *,
        number: int = 1,
        parent: str = "",
        run_id: str = "run-1",
        dp_epsilon: float = 0.0,
        roster_sha256: bytes | None = None,
    ) -> pb.RoundConfig:
        """A RoundConfig with a plan for ``round_id`` signed with the server's key, binding
        ``roster_sha256`` (default: the federation's roster)."""
        plan = build_plan(
            federation_id=FED, round_id=round_id, round_number=number, participants=SITES,
            gram_scope="global", releases=releases,
        )  # fmt: skip
        plan.roster_sha256 = self.roster_sha256 if roster_sha256 is None else roster_sha256
        if dp_epsilon:
            settings = DpSettings(epsilon=dp_epsilon, delta=1e-5, clip_norm=2.0)
            apply_dp(plan, calibrate(releases, settings, participants=SITES, plaintext=True))
        signed = sign_plan(plan, self.server_key)
        self.log.publish_plan(round_id, signed.plan)
        return pb.RoundConfig(
            federation_id=FED, round_id=round_id, round_number=number, parent_round_id=parent,
            participants=list(SITES), class_names=list(CLASSES), feature_dim=D,
            aggregation=plan.aggregation, gram_scope=plan.gram_scope, run_id=run_id,
            release_plan=signed,
        )  # fmt: skip


@pytest.fixture
def site(
    federation: ProvisionedFederation, tmp_path: Path
) -> tuple[ClientDaemon, Coordinator, Path]:
    """Site s4 (plaintext allowed) with its cache, prepared; the coordinator."""
    n = 16
    rng = np.random.default_rng(5)  # test data, not secrets
    labels = np.stack([np.arange(n) % 2, (np.arange(n) // 2) % 2], axis=1).astype(np.int8)
    write_cache(
        tmp_path / "cache",
        meta=CacheMeta(n=n, d=D, classes=CLASSES, source="test", extra={"backbone": "test"}),
        ids=[str(i) for i in range(n)],
        labels=labels,
        features=rng.normal(size=(n, D)).astype(np.float32),
        patients=[f"p{i}" for i in range(n)],
    )
    config = load_client_config(federation.site_dirs[SITE] / "client.toml")
    state = tmp_path / "site" / "state"
    config = replace(
        config,
        state_dir=state,
        data=DataConfig(tmp_path / "cache"),
        # The only witness here is this site: its own cosignature is the quorum.
        policy=LocalPolicy(allowed_aggregation=("plaintext",), witness_quorum=1),
    )
    daemon = ClientDaemon(config)
    daemon.prepare()
    server = load_config(federation.server_dir / "server.toml")
    key = signatures.load_private_key_pem(server.identity_key.read_bytes())
    keys = {s: e.identity_public_key for s, e in server.sites.items()}
    roster = roster_digest(federation=FED, keys=keys)  # from server.toml, not the site's kit
    coordinator = Coordinator(key, tmp_path / "coordinator", roster)
    coordinator.log.enrol(SITE, config.identity_public_key)
    daemon.rpc = coordinator  # type: ignore[assignment]
    return daemon, coordinator, state


def _report() -> RoundReport:
    return RoundReport("s1", "fed", "run", "", 0)


def _files_outside(root: Path, inside: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and inside not in p.parents]


def test_a_round_id_that_is_a_path_writes_nothing_outside_the_state(
    site: tuple[ClientDaemon, Coordinator, Path], tmp_path: Path
) -> None:
    """The coordinator chooses round ids; the site uses them in file names (its report, the
    models it keeps, its ledger). A round id such as ``../../x`` must never name a file outside
    the state folder (here it would overwrite ``history.json`` or a ledger entry, or write
    anywhere the site's user can)."""
    daemon, coordinator, state = site
    before = set(_files_outside(tmp_path, state))
    evil = "../../escaped"
    # A plan the site refuses (a 2-member release): it writes its report, named by the round.
    refused = [_gram("gram[all]", SITES), _b("A", ("s3", "s4"))]
    coordinator.announce(evil, coordinator.round_config(evil, refused))
    with pytest.raises(DaemonError, match="not a valid round id"):
        daemon._rounds()
    assert set(_files_outside(tmp_path, state)) == before
    assert coordinator.uploads == [] and coordinator.decisions() == []


def test_a_plan_binding_another_roster_is_refused(
    site: tuple[ClientDaemon, Coordinator, Path], federation: ProvisionedFederation
) -> None:
    """M-221 (attack 6): the coordinator's plan binds a roster in which peer s1's identity key is
    the operator's; s4's kit holds s1's real key: s4 refuses the plan, naming both digests, and
    uploads nothing; the same plan over the real roster is accepted; a plan binding no roster
    is refused."""
    daemon, coordinator, _ = site
    server = load_config(federation.server_dir / "server.toml")
    keys = {s: e.identity_public_key for s, e in server.sites.items()}
    operator = signatures.public_key_to_raw(signatures.generate_identity_key())
    forged = roster_digest(federation=FED, keys={**keys, "s1": operator})
    for round_id, digest in (("r1-forged", forged), ("r1-unbound", b"")):
        cfg = coordinator.round_config(round_id, GLOBAL, roster_sha256=digest)
        with pytest.raises(RoundFailed) as refused:
            daemon.run_round(coordinator.announce(round_id, cfg), _report())
        assert refused.value.outcome == pb.CLIENT_OUTCOME_REFUSED_PLAN
        assert "roster" in refused.value.reason
        if digest:
            assert forged.hex()[:16] in refused.value.reason
    assert coordinator.uploads == []
    good = coordinator.announce("r1-honest", coordinator.round_config("r1-honest", GLOBAL))
    daemon.run_round(good, _report())
    assert [d.accept for d in coordinator.decisions()][-1] is True
    assert {u[0] for u in coordinator.uploads} == {"r1-honest"}


def test_a_config_for_another_round_is_refused(
    site: tuple[ClientDaemon, Coordinator, Path],
) -> None:
    """Round r2 is announced, but its RoundConfig (and signed plan) is bound to r1, a round the
    site completed: the site would audit the new plan without r1's releases (the history of
    the plan's own round is left out) and overwrite r1's history, so gram[all] of r1 and
    gram{s1,s2,s3} of the new plan expose G_s4 by differencing."""
    daemon, coordinator, _ = site
    first = coordinator.announce("r1-aaaa", coordinator.round_config("r1-aaaa", GLOBAL))
    daemon.run_round(first, _report())
    assert [d.accept for d in coordinator.decisions()] == [True]
    rebound = coordinator.round_config("r1-aaaa", DIFFERENCING)
    second = coordinator.announce("r2-bbbb", rebound)
    with pytest.raises(RoundFailed) as refused:
        daemon.run_round(second, _report())
    assert refused.value.outcome == pb.CLIENT_OUTCOME_REFUSED_PLAN
    assert "r1-aaaa" in refused.value.reason
    assert [u for u in coordinator.uploads if u[0] == "r2-bbbb"] == []
    assert {r.name for r in daemon.store.history(exclude_round="")} >= {"r1-aaaa/gram[all]"}


def test_a_config_stating_another_wire_version_is_refused_naming_both(
    site: tuple[ClientDaemon, Coordinator, Path],
) -> None:
    """A coordinator of another afl release (wire protocol version) is refused before the plan is
    acted on: the refusal names both versions; nothing is uploaded."""
    daemon, coordinator, _ = site
    cfg = coordinator.round_config("r1-aaaa", GLOBAL)
    cfg.protocol_version = wire.PROTOCOL_VERSION + 1
    with pytest.raises(RoundFailed) as refused:
        daemon.run_round(coordinator.announce("r1-aaaa", cfg), _report())
    assert refused.value.outcome == pb.CLIENT_OUTCOME_REFUSED_PLAN
    assert (
        f"speaks wire protocol {wire.PROTOCOL_VERSION + 1}, this site speaks "
        f"{wire.PROTOCOL_VERSION}" in refused.value.reason
    )
    assert coordinator.uploads == [] and [d.accept for d in coordinator.decisions()] == [False]


def _plan_log_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("plan-log-")]


def test_the_plan_s_log_check_ends_with_the_plan_review_on_every_path(
    site: tuple[ClientDaemon, Coordinator, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan's log check runs beside the site's own (client/daemon/loop.py ``PlanLogCheck``)
    and waits up to the stage deadline for a plan the log does not hold: a refusal or a failure
    of the site's own check ends it with the plan review (a thread left polling could later
    change what the site witnesses), and the refusal is sent either way. Here the signed bytes
    are not the logged plan's and the unsigned ``aggregation`` is a value no release knows."""
    daemon, coordinator, _ = site
    cfg = coordinator.round_config("r1-aaaa", GLOBAL)
    cfg.release_plan.plan += b"\x00"  # not the logged plan; its signature no longer verifies
    cfg.aggregation = 99  # type: ignore[assignment]
    report = _report()
    with pytest.raises(RoundFailed) as refused:
        daemon.run_round(coordinator.announce("r1-aaaa", cfg), report)
    assert refused.value.outcome == pb.CLIENT_OUTCOME_REFUSED_PLAN
    assert [d.accept for d in coordinator.decisions()] == [False]
    assert report.plan is not None and report.plan["aggregation"] == "UNKNOWN(99)"
    assert _plan_log_threads() == []

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the site's own plan check failed")

    monkeypatch.setattr(daemon, "_decide", broken)
    second = coordinator.round_config("r2-bbbb", GLOBAL)
    second.release_plan.plan += b"\x00"
    with pytest.raises(RuntimeError, match="own plan check failed"):
        daemon.run_round(coordinator.announce("r2-bbbb", second), _report())
    assert _plan_log_threads() == []


def test_a_second_plan_under_a_round_id_already_uploaded_under_is_refused(
    site: tuple[ClientDaemon, Coordinator, Path],
) -> None:
    """The site uploaded under plan P1 of round r1 (its ledger says so) and restarted; the
    coordinator announces r1 again with another plan. Audit and DP budgets leave out the
    site's own releases of "this" round, so P1 would not count against P2: refused."""
    daemon, coordinator, _ = site
    first = coordinator.announce("r1-aaaa", coordinator.round_config("r1-aaaa", GLOBAL))
    daemon.run_round(first, _report())
    coordinator.rounds.clear()
    again = coordinator.announce("r1-aaaa", coordinator.round_config("r1-aaaa", DIFFERENCING))
    with pytest.raises(RoundFailed) as refused:
        daemon.run_round(again, _report())
    assert refused.value.outcome == pb.CLIENT_OUTCOME_REFUSED_PLAN
    assert "another release plan" in refused.value.reason
    assert len(coordinator.uploads) == len(GLOBAL)  # P1's only


def test_a_round_two_must_compose_with_a_round_one_in_the_sites_ledger(
    site: tuple[ClientDaemon, Coordinator, Path],
) -> None:
    """max_epsilon bounds a run (docs/protocol.md M-88): a DP round 2 composes with the site's
    ledger entry for its round 1. A round-2 plan naming a parent round the site never uploaded
    under (or one of another run) would compose with nothing."""
    daemon, coordinator, _ = site
    daemon.config = replace(daemon.config, policy=replace(daemon.config.policy, max_epsilon=3.0))
    releases = dp_releases(
        classes=CLASSES, participants=SITES, coverage={}, gram_scope="global", d=D
    )
    first = coordinator.announce(
        "r1-aaaa", coordinator.round_config("r1-aaaa", releases, dp_epsilon=2.5)
    )
    daemon.run_round(first, _report())
    spent = daemon.ledger.entry_for("r1-aaaa")
    assert spent is not None and 2.0 < spent.epsilon <= 3.0
    honest = coordinator.round_config(
        "r2-bbbb", releases, number=2, parent="r1-aaaa", dp_epsilon=2.5
    )
    decision, _, _ = daemon._decide(honest, round_id="r2-bbbb")
    assert not decision.accept and "over its run" in decision.reason  # √2·μ > max_epsilon 3
    for parent, run_id in (("r1-never", "run-1"), ("", "run-1"), ("r1-aaaa", "run-2")):
        forged = coordinator.round_config(
            "r2-bbbb", releases, number=2, parent=parent, run_id=run_id, dp_epsilon=2.5
        )
        decision, _, _ = daemon._decide(forged, round_id="r2-bbbb")
        assert not decision.accept, (parent, run_id)
        assert "round 1" in decision.reason and math.isfinite(spent.epsilon)


def test_a_signed_plan_that_does_not_parse_is_refused_in_one_line(
    site: tuple[ClientDaemon, Coordinator, Path],
) -> None:
    daemon, coordinator, _ = site
    cfg = coordinator.round_config("r1-aaaa", GLOBAL)
    garbage = b"\xff\xff\xff\xff"
    cfg.release_plan.CopyFrom(
        cpb.SignedReleasePlan(
            plan=garbage,
            signature=sign_blob(coordinator.server_key, context=PLAN_CONTEXT, blob=garbage),
        )
    )
    status = coordinator.announce("r1-aaaa", cfg)
    with pytest.raises(RoundFailed, match="does not parse"):
        daemon.run_round(status, _report())


def test_a_model_file_whose_round_id_is_a_path_is_refused_by_evaluate(
    site: tuple[ClientDaemon, Coordinator, Path], tmp_path: Path
) -> None:
    """``afl-client evaluate --model FILE`` names the report it updates by the model's round id;
    a model file the coordinator signed for round ``../../x`` must not write outside the
    state (one line: the model file is refused)."""
    daemon, coordinator, state = site
    before = set(_files_outside(tmp_path, state))
    cfg = coordinator.round_config("r1-aaaa", GLOBAL)
    signed = build_signed_model(
        np.zeros((D, len(CLASSES))), identity_key=coordinator.server_key, federation_id=FED,
        round_id="../../escaped", round_number=1, classes=CLASSES, gamma=1.0, backbone="test",
        contributors=SITES, plan_bytes=cfg.release_plan.plan,
    )  # fmt: skip
    model = tmp_path / "model" / "m.signed-model.pb"
    model.parent.mkdir()
    model.write_bytes(signed.SerializeToString())
    before.add(model)
    with pytest.raises(ModelFileError, match="not a valid round id"):
        run = evaluate_model(  # even with the log proof skipped, the round id is checked
            daemon.config, model_path=model, cache=tmp_path / "cache", n_boot=5, unverified=True
        )
        write_local_evaluation(state, run)
    assert set(_files_outside(tmp_path, state)) == before


class _Filler:
    """What the daemon calls of its :class:`afl.client.modes.ckks.ZeroFiller`, recorded with
    the round the daemon was in at the call."""

    def __init__(self, daemon: ClientDaemon) -> None:
        self.daemon = daemon
        self.calls: list[tuple[str, str]] = []

    def pause(self) -> None:
        self.calls.append(("pause", self.daemon._running_round))

    def resume(self) -> None:
        self.calls.append(("resume", self.daemon._running_round))

    def zeros_for(self, context_sha256: bytes) -> Any:
        return lambda: None

    def stop(self) -> None:
        self.calls.append(("stop", ""))

    def join(self, timeout_s: float) -> None:
        self.calls.append(("join", ""))


def test_a_completed_round_s_release_cosignature_leaves_after_its_model_and_before_its_report(
    site: tuple[ClientDaemon, Coordinator, Path],
) -> None:
    """The round's release check keeps its cosignature of the checkpoint that holds the
    round's release (M-198, M-230) past the model; the daemon sends it before the round's
    report, and the status answers that show the round published need no witnessing step of
    their own (the daemon records their key)."""
    daemon, coordinator, _ = site
    coordinator.announce("r1-aaaa", coordinator.round_config("r1-aaaa", GLOBAL))
    assert daemon._rounds() == 0
    calls = [what for what, _ in coordinator.calls]
    model, report = calls.index("GetModel"), calls.index("SubmitReport")
    cosigned = [i for i, what in enumerate(calls) if what == "CosignCheckpoint"]
    assert model < cosigned[-1] < report, calls
    assert daemon.log_witness.last is not None
    assert daemon.log_witness.last.checkpoint.size == coordinator.log.store.log_size()
    assert coordinator.log.cosigned[-1] == SITE  # on the checkpoint that holds the release
    published = pb.RoundStatus(
        round_id="r1-aaaa", stage=pb.ROUND_STAGE_PUBLISHED, participants=list(SITES)
    )
    assert daemon._witnessed_key == witness_key(published, "r1-aaaa", site_id=SITE)


def test_the_zero_filler_rests_during_every_round_it_completed_or_refused(
    site: tuple[ClientDaemon, Coordinator, Path],
) -> None:
    """M-237: the site draws encryptions of zero only while it waits; each round, completed or
    refused, pauses the drawing before its plan is read and resumes it after."""
    daemon, coordinator, _ = site
    filler = _Filler(daemon)
    daemon._zeros = filler  # type: ignore[assignment]
    coordinator.announce("r1-aaaa", coordinator.round_config("r1-aaaa", GLOBAL))
    assert daemon._rounds() == 0
    # paused once the round is taken up (before its plan is read), resumed after it ended
    assert filler.calls == [("pause", "r1-aaaa"), ("resume", "")]
    refused = [_gram("gram[all]", SITES), _b("A", ("s3", "s4"))]  # a 2-member release
    coordinator.announce("r1-bbbb", coordinator.round_config("r1-bbbb", refused))
    daemon._rounds()
    assert filler.calls[2:] == [("pause", "r1-bbbb"), ("resume", "")]


def test_only_a_site_that_allows_ckks_and_pins_another_decryptor_draws_zeros(
    site: tuple[ClientDaemon, Coordinator, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon, _, _ = site
    monkeypatch.setattr(ZeroFiller, "start", lambda self: self)  # which filler, not its thread
    assert daemon._zero_filler() is None  # plaintext only
    for policy, draws in (
        (LocalPolicy(allowed_aggregation=("ckks",), ckks_decryptor="s1"), True),
        (LocalPolicy(allowed_aggregation=("mask",), ckks_decryptor="s1"), False),
        (LocalPolicy(allowed_aggregation=("ckks",), ckks_decryptor=SITE), False),
        (LocalPolicy(allowed_aggregation=("ckks",)), False),
    ):
        daemon.config = replace(daemon.config, policy=policy)
        filler = daemon._zero_filler()
        assert (filler is not None) == draws, policy
        if filler is not None:
            filler.close()
    daemon.config = replace(daemon.config, ckks_draw_ahead=False)  # [client] switches it off
    assert daemon._zero_filler() is None
