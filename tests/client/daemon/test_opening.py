"""A site's `opening` statement (docs/protocol.md §11a, M-232), against the coordinator's real
log (:class:`afl.server.transparency.FederationLog` on a real store) behind the in-process RPC
stand-in: the site logs its signed word that it helps unmask a round over the survivors it
signed, and sends no unmask share until that statement is in a checkpoint a quorum of the roster
cosigned; the coordinator appends only a statement its caller signed, over a plan in the log;
every site's audit counts only openings that verify under the roster."""

from __future__ import annotations

import threading
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from afl.client.daemon.opening import (
    Opened,
    OpeningPublication,
    counted_releases,
    never_decrypted,
    opened_releases,
    opening_of,
    signed_opening,
    undecrypted_aborts,
    witnessed_releases,
)
from afl.client.daemon.rpc import CoordinatorClient
from afl.client.daemon.transparency import LogWitness
from afl.client.daemon.transport import DaemonError
from afl.client.modes.base import RoundSession
from afl.client.modes.mask import MASK_STEPS
from afl.client.policy.loghistory import logged_rounds, release_fields, whole_history_problem
from afl.crypto.identity.signatures import generate_identity_key, public_key_to_raw, sign_fields
from afl.crypto.transparency.statements import (
    DECRYPTING_CONTEXT,
    decode_statement,
    decrypting_signed_fields,
    decrypting_statement,
    opened_release_statement,
    opening_statement,
    plan_statement,
    release_sha256,
    statement_bytes,
)
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.errors import InvalidRequestError, NotPermittedError, WrongStageError
from tests.helpers.fedlog import LogService, site_witness

FED = "fed-opening"
COORDINATOR = generate_identity_key()
SITES = {f"site-{i}": generate_identity_key() for i in (1, 2, 3)}
ROSTER = {s: public_key_to_raw(k) for s, k in SITES.items()}
SURVIVORS = ("site-1", "site-2", "site-3")


def _plan(round_id: str = "r1-open") -> cpb.ReleasePlan:
    return cpb.ReleasePlan(
        round_id=round_id,
        run_id="run-1",
        participants=list(SURVIVORS),
        aggregation=cpb.AGGREGATION_MODE_MASK,
        releases=[
            cpb.Release(
                name="gram[all]",
                kind=cpb.STATISTIC_KIND_GRAM,
                member_site_ids=list(SURVIVORS),
            )
        ],
    )


def _coordinator(state: Path) -> LogService:
    service = LogService(state, key=COORDINATOR, federation_id=FED)
    for site, key in ROSTER.items():
        service.enrol(site, key)
    service.survivors_of = lambda round_id: SURVIVORS  # the masked round's, at the coordinator
    return service


def _witness(state: Path, site: str = "site-1", *, quorum: int = 0) -> LogWitness:
    return site_witness(
        state / site, federation=FED, site=site, keys=SITES, coordinator=COORDINATOR, quorum=quorum
    )


def _publication(
    witness: LogWitness, call: Any, plan: cpb.ReleasePlan, plan_sha: bytes, *, wait_s: float = 60
) -> OpeningPublication:
    return OpeningPublication(
        witness,
        call,
        key=SITES[witness.site_id],
        plan=plan,
        plan_sha256=plan_sha,
        quorum_wait=lambda **step: witness.quorum_problem(
            call, wait_s=wait_s, poll_s=0.01, max_poll_s=0.05, **step
        ),
    )


def _statements(service: LogService) -> list[tuple[str, dict[str, object]]]:
    return [
        decode_statement(entry, federation=FED)
        for _, _, entry, _ in service.store.log_entries(0, service.store.log_size())
    ]


def test_the_opening_is_in_a_quorum_checkpoint_before_the_wait_returns(tmp_path: Path) -> None:
    """Two of the three roster sites must cosign a checkpoint that holds the statement: the
    wait returns only after the second witness cosigned one."""
    coordinator = _coordinator(tmp_path / "server")
    plan = _plan()
    plan_sha = coordinator.publish_plan(plan.round_id, plan.SerializeToString())
    witness = _witness(tmp_path)
    publication = _publication(witness, coordinator.call, plan, plan_sha)
    publication.start(SURVIVORS)
    other = _witness(tmp_path, "site-2")
    done = threading.Event()

    def wait() -> None:
        publication.wait()
        done.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        assert not done.wait(0.5)  # one cosignature of three: no quorum yet
        assert [k for k, _ in _statements(coordinator)][-1] == "opening"
        coordinator.caller = "site-2"  # the second witness cosigns the newest checkpoint
        other.witness(coordinator.call)
        assert done.wait(60)
    finally:
        waiter.join(timeout=60)
    (body_kind, body), (kind, fields) = _statements(coordinator)[-2:]
    release = release_fields(plan, survivors=SURVIVORS)
    assert body_kind == "opened-release" and body == release  # logged once, before the opening
    assert kind == "opening" and fields["site"] == "site-1"
    assert fields["release_sha256"] == release_sha256(release).hex()
    assert fields["plan_sha256"] == plan_sha.hex() and fields["round_id"] == plan.round_id


@pytest.mark.parametrize("tamper", [False, True])
@pytest.mark.parametrize("logged", ["RecordOpening", "ConsistencyCheck"])
def test_the_release_s_inclusion_proof_comes_with_the_quorum_s_answer(
    tmp_path: Path, tamper: bool, logged: str
) -> None:
    """The quorum wait asks every checkpoint answer for the inclusion proof of the release the
    opening signs (``also_leaf``), so the wait costs no GetInclusionProof; a carried proof that
    does not verify in that checkpoint is refused, naming the release, and nothing is sent.
    The opening is logged with RecordOpening (``ckks``) or, as the coordinator does with the
    masked round's consistency signature that carries it, from :meth:`carried` (``mask``)."""
    coordinator = _coordinator(tmp_path / "server")
    plan = _plan()
    plan_sha = coordinator.publish_plan(plan.round_id, plan.SerializeToString())
    calls: list[str] = []

    def call(what: str, request: Any) -> Any:
        calls.append(what)
        answer = coordinator.call(what, request)
        if tamper and what == "GetCheckpoint" and answer.HasField("also_inclusion"):
            answer.also_inclusion.index += 1  # the proof of another position
        return answer

    publication = _publication(_witness(tmp_path, quorum=1), call, plan, plan_sha)
    if logged == "RecordOpening":
        publication.start(SURVIVORS)
    else:
        coordinator.call("RecordOpening", pb.Opening(statement=publication.carried(SURVIVORS)))
    if tamper:
        with pytest.raises(DaemonError, match="the release this site's opening of round r1-open"):
            publication.wait()
    else:
        publication.wait()
    assert "GetInclusionProof" not in calls and "GetCheckpoint" in calls


@pytest.mark.parametrize("release", ["never", "after-the-quorum"])
def test_an_opening_whose_release_is_not_logged_gets_no_unmask_share(
    tmp_path: Path, release: str
) -> None:
    """A coordinator that logs the site's opening but not the release whose digest it signs
    (so no other site's audit could read what the round released), or logs that release only
    after the checkpoint the quorum cosigned: the opening reaches a quorum's checkpoint, but the
    wait fails naming the missing release, and nothing is sent."""
    coordinator = _coordinator(tmp_path / "server")
    plan = _plan()
    plan_sha = coordinator.publish_plan(plan.round_id, plan.SerializeToString())
    honest = coordinator.call

    def without_release(what: str, request: Any) -> object:
        if what == "RecordOpening":
            _, fields = decode_statement(request.statement, federation=FED)
            return pb.LogProof(index=coordinator.store.append_log("opening", fields))
        if what == "GetInclusionProof" and release == "after-the-quorum":
            body = release_fields(plan, survivors=SURVIVORS)
            if "opened-release" not in [k for k, _ in _statements(coordinator)]:
                coordinator.store.append_log("opened-release", body)
        return honest(what, request)

    witness = _witness(tmp_path, quorum=1)
    publication = _publication(witness, without_release, plan, plan_sha)
    publication.start(SURVIVORS)
    with pytest.raises(DaemonError, match="the release this site's opening of round r1-open signs"):
        publication.wait()
    kinds = [k for k, _ in _statements(coordinator)]
    assert kinds[-1 if release == "never" else -2] == "opening"
    assert kinds.count("opened-release") == (0 if release == "never" else 1)


def test_a_round_that_ended_stops_the_wait_for_the_opening_s_quorum(tmp_path: Path) -> None:
    """A CKKS site whose exchange failed while its opening waited for the roster's quorum (here:
    no other witness ever cosigns) sets ``stopped``: the wait ends at its next poll with the
    cause, instead of holding the site's failure report for the stage timeout (600 s here)."""
    coordinator = _coordinator(tmp_path / "server")
    plan = _plan()
    plan_sha = coordinator.publish_plan(plan.round_id, plan.SerializeToString())
    publication = _publication(_witness(tmp_path), coordinator.call, plan, plan_sha, wait_s=600)
    publication.start(SURVIVORS)
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            publication.wait()
        except DaemonError as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    publication.stopped.set()
    waiter.join(timeout=120)  # generous: no timing is asserted beyond "long before 600 s"
    assert not waiter.is_alive()
    [error] = raised
    assert "the log check of this site's opening of round r1-open was stopped" in str(error)
    assert "no unmask share is sent" in str(error)


def test_a_coordinator_that_drops_the_opening_gets_no_unmask_share(tmp_path: Path) -> None:
    """RecordOpening answered, nothing appended: the wait fails naming the cause, and the
    masked exchange's unmask step sends nothing."""
    coordinator = _coordinator(tmp_path / "server")
    plan = _plan()
    plan_sha = coordinator.publish_plan(plan.round_id, plan.SerializeToString())
    honest = coordinator.call

    def dropping(what: str, request: object) -> object:
        if what == "RecordOpening":
            return pb.LogProof(index=0)
        return honest(what, request)

    witness = _witness(tmp_path, quorum=1)
    publication = _publication(witness, dropping, plan, plan_sha, wait_s=0.3)
    publication.start(SURVIVORS)
    sent: list[str] = []
    session = RoundSession(
        rpc=cast(CoordinatorClient, SimpleNamespace(call=lambda what, m: sent.append(what))),
        round_id=plan.round_id,
        site_id="site-1",
        plan=plan,
        identity_key=SITES["site-1"],
        before_unmask=publication.wait,
    )
    unmask = MASK_STEPS[-1]
    assert unmask.get == "GetUnmaskRequest"
    with pytest.raises(DaemonError, match="this site's opening of round r1-open is not in a"):
        unmask.act(session, cast(Any, None), None)
    assert sent == []
    assert "opening" not in [k for k, _ in _statements(coordinator)]


def test_an_opening_is_needed_before_the_unmask_share(tmp_path: Path) -> None:
    witness = _witness(tmp_path, quorum=1)
    publication = _publication(witness, lambda what, request: None, _plan(), b"\0" * 32)
    with pytest.raises(DaemonError, match="no opening was logged for the survivors"):
        publication.wait()


def test_the_coordinator_appends_only_an_opening_its_caller_signed_over_a_logged_plan(
    tmp_path: Path,
) -> None:
    coordinator = _coordinator(tmp_path / "server")
    plan = _plan()
    plan_sha = coordinator.publish_plan(plan.round_id, plan.SerializeToString())

    def record(site: str, statement: bytes) -> int:
        return coordinator.log.record_opening(site, statement, survivors_of=lambda r: SURVIVORS)

    def mine(site: str, **change: Any) -> bytes:
        args: dict[str, Any] = {
            "federation": FED, "site": site, "plan": plan, "plan_sha256": plan_sha,
            "survivors": SURVIVORS,
        }  # fmt: skip
        return opening_of(SITES[site], **{**args, **change}).opening

    with pytest.raises(NotPermittedError, match="names site 'site-2', the caller is 'site-1'"):
        record("site-1", mine("site-2"))
    digest = release_sha256(release_fields(plan, survivors=SURVIVORS))
    forged = opening_statement(
        federation=FED,
        site="site-1",
        round_id=plan.round_id,
        plan_sha256=plan_sha,
        mode="mask",
        release_sha256=digest,
        signature=b"\1" * 64,
    )
    with pytest.raises(NotPermittedError, match="opening signature does not verify"):
        record("site-1", forged)
    with pytest.raises(NotPermittedError, match="site site-1 is not among round r1-open's survi"):
        coordinator.log.record_opening(
            "site-1", mine("site-1"), survivors_of=lambda r: ("site-2", "site-3")
        )
    in_ckks = signed_opening(  # signed, but in another mode
        SITES["site-1"],
        federation=FED,
        site="site-1",
        round_id=plan.round_id,
        plan_sha256=plan_sha,
        mode="ckks",
        release_sha256=digest,
    )
    with pytest.raises(NotPermittedError, match="states mode 'ckks'; round r1-open runs mask"):
        record("site-1", in_ckks)
    with pytest.raises(WrongStageError, match="holds no plan of round 'r1-open' with the digest"):
        record("site-1", mine("site-1", plan_sha256=b"\2" * 32))
    other = cpb.ReleasePlan()
    other.CopyFrom(plan)
    other.releases[0].member_site_ids[:] = ["site-1", "site-2"]  # not the logged plan's members
    with pytest.raises(NotPermittedError, match="misstates round r1-open: the release it signs"):
        record("site-1", mine("site-1", plan=other))
    for fewer in (("site-1",), ("site-1", "site-2"), ("site-2", "site-3")):  # not the survivors
        with pytest.raises(NotPermittedError, match="over the round's survivors"):
            record("site-1", mine("site-1", survivors=fewer))

    def not_masking(round_id: str) -> list[str]:
        raise WrongStageError(f"round {round_id!r} is ROUND_STAGE_PLAN_REVIEW")

    with pytest.raises(WrongStageError, match="PLAN_REVIEW"):  # outside the last two stages
        coordinator.log.record_opening("site-1", mine("site-1"), survivors_of=not_masking)
    with pytest.raises(InvalidRequestError, match="not a well-formed opening"):
        record("site-1", _statements_bytes(coordinator)[0])  # the plan statement
    _, honest = decode_statement(mine("site-1"), federation=FED)
    for field in ("release_sha256", "plan_sha256"):  # one digest, one spelling: the signed one
        for spelled in (str(honest[field]).upper(), f"{honest[field]}00"):
            other_form = statement_bytes(
                federation=FED, kind="opening", fields={**honest, field: spelled}
            )
            with pytest.raises(InvalidRequestError, match="not a SHA-256 in lower-case hex"):
                record("site-1", other_form)
    size = coordinator.store.log_size()
    first = record("site-1", mine("site-1"))
    assert record("site-1", mine("site-1")) == first == size + 1  # appended once ...
    assert record("site-2", mine("site-2")) == size + 2  # ... after the round's release, once
    kinds = [k for k, _ in _statements(coordinator)][size:]
    assert kinds == ["opened-release", "opening", "opening"]


def _statements_bytes(service: LogService) -> list[bytes]:
    return [entry for _, _, entry, _ in service.store.log_entries(0, service.store.log_size())]


def test_the_audit_counts_only_openings_that_verify_under_the_roster(tmp_path: Path) -> None:
    plan = _plan()
    plan_sha = b"\3" * 32
    release = release_fields(plan, survivors=SURVIVORS)

    def signed(key: Any, site: str, survivors: tuple[str, ...] = SURVIVORS) -> list[bytes]:
        return list(
            opening_of(
                key, federation=FED, site=site, plan=plan, plan_sha256=plan_sha, survivors=survivors
            )
        )

    (good, body) = signed(SITES["site-2"], "site-2")
    (by_stranger, _) = signed(generate_identity_key(), "site-3")
    (not_a_survivor, other_body) = signed(SITES["site-1"], "site-1", ("site-2", "site-3"))
    planned = plan_statement(federation=FED, round_id=plan.round_id, plan_sha256=plan_sha)
    statements = [
        decode_statement(s, federation=FED)
        for s in (planned, body, other_body, good, by_stranger, not_a_survivor)
    ]
    keys = _witness(tmp_path).roster
    verified: set[str] = set()
    # as a witness reads them: read-only views of the fields
    viewed = [(k, MappingProxyType(f)) for k, f in statements]
    opened = opened_releases(viewed, federation=FED, keys=keys, verified=verified)
    assert opened == [Opened("site-2", plan_sha.hex(), "mask", release)] and len(verified) == 1
    assert counted_releases(opened) == [release]  # over its survivors, whoever signed it ...
    assert witnessed_releases(opened) == []  # ... but only site-2 of the three signed it
    # counted as a released round of the log (its survivors, its planned releases)
    (released,) = logged_rounds([("release", o.release) for o in opened])
    assert released.round_id == plan.round_id and tuple(released.contributors) == SURVIVORS
    # verified once: a statement that verified is not verified again ...
    assert opened_releases(statements[:4], federation=FED, keys=keys, verified=verified) == opened
    # ... which is the whole statement: the same signature over another release of the log (the
    # one site-1 opened, over two survivors) is not counted
    kind, fields = statements[3]
    forged = {**fields, "release_sha256": release_sha256(statements[2][1]).hex()}
    copied = opened_releases(
        [*statements[:3], (kind, forged)], federation=FED, keys=keys, verified=verified
    )
    assert copied == []
    assert opened_releases(statements[:4], federation="fed-other", keys=keys) == []
    # an opening of a plan the log does not hold, or whose release the log does not hold, or
    # whose release is malformed or of another round, is not counted
    assert opened_releases(statements[1:4], federation=FED, keys=keys) == []
    assert opened_releases([statements[0], statements[3]], federation=FED, keys=keys) == []
    # (each signed by site-2 itself over the digest of that release: only the checks of the
    # release refuse them; a site may not pin its plan's round on another round's release)
    for wrong in ({**release, "round_id": None}, {**release, "round_id": "r9-other"}):
        fake = opened_release_statement(federation=FED, release=wrong)
        opening = signed_opening(
            SITES["site-2"],
            federation=FED,
            site="site-2",
            round_id=plan.round_id,
            plan_sha256=plan_sha,
            mode="mask",
            release_sha256=release_sha256(wrong),
        )
        log = [statements[0], *(decode_statement(e, federation=FED) for e in (fake, opening))]
        assert opened_releases(log, federation=FED, keys=keys) == []


def _plan_over(round_id: str, sites: tuple[str, ...]) -> cpb.ReleasePlan:
    return cpb.ReleasePlan(
        round_id=round_id,
        run_id=f"run-{round_id}",
        participants=list(sites),
        releases=[
            cpb.Release(name="gram[all]", kind=cpb.STATISTIC_KIND_GRAM, member_site_ids=list(sites))
        ],
    )


def _released(round_id: str, planned: tuple[str, ...], survivors: tuple[str, ...]) -> Any:
    return ("release", release_fields(_plan_over(round_id, planned), survivors=survivors))


def test_an_unwitnessed_release_makes_the_audit_stricter_never_more_lenient() -> None:
    """A release no single party's word may make known before (one site's opening, the
    coordinator's statement of a round nobody else signed) counts as released, never as what
    was known before: releases of r1 over {M} and {M, V} (which would make V's statistics look
    exposed already) do not let through a plan that differences the witnessed r1 to V."""
    everyone = ("site-1", "site-2", "site-3", "V", "M")
    witnessed = logged_rounds([_released("r1", everyone, everyone)])
    plan = _plan_over("r3", ("site-1", "site-2", "site-3", "M"))
    claimed = logged_rounds(
        [_released("r1", everyone, ("M",)), _released("r1", everyone, ("M", "V"))]
    )
    every = [*witnessed, *claimed]
    problem, _ = whole_history_problem(plan, rounds=every, known=witnessed, min_cohort=1)
    assert "would expose" in problem and "V" in problem, problem
    # had the claims been taken as known before, V would count as exposed before
    lenient, _ = whole_history_problem(plan, rounds=every, min_cohort=1)
    assert lenient == ""
    # a claim alone is a release: it refuses a plan that differences it to one site
    alone = logged_rounds([_released("r1", everyone, ("site-1", "site-2", "site-3", "V"))])
    strict, _ = whole_history_problem(
        _plan_over("r4", ("site-1", "site-2", "site-3")), rounds=alone, known=[], min_cohort=1
    )
    assert "would expose" in strict and "V" in strict, strict


def test_a_release_is_witnessed_only_when_every_survivor_signed_the_same_opening() -> None:
    """M-233: the known-before part of the history is what every survivor of a release signed
    alike; a release that one site states (or one survivor fewer signed, or that the survivors
    stated differently, or under another plan) is not."""
    plan = _plan()
    release = release_fields(plan, survivors=SURVIVORS)
    by = {s: Opened(s, "aa" * 32, "mask", release) for s in SURVIVORS}
    assert witnessed_releases(list(by.values())) == [release]
    assert witnessed_releases([by["site-1"], by["site-2"]]) == []  # site-3 did not sign
    assert witnessed_releases([*by.values(), *by.values()]) == [release]  # repeats add nothing
    # the same signers, one of them under another plan digest or over other survivors
    assert (
        witnessed_releases(
            [by["site-1"], by["site-2"], Opened("site-3", "bb" * 32, "mask", release)]
        )
        == []
    )
    fewer = release_fields(plan, survivors=SURVIVORS[:2])
    mixed = [
        Opened("site-1", "aa" * 32, "mask", fewer),
        Opened("site-2", "aa" * 32, "mask", fewer),
        by["site-3"],
    ]
    assert witnessed_releases(mixed) == [fewer]  # {1, 2} signed the two-site release ...
    # ... and a claim over one site is witnessed by that site alone, as it should be: the
    # coordinator can make such a statement only with the site's own key
    lone = release_fields(plan, survivors=("site-3",))
    assert witnessed_releases([Opened("site-3", "aa" * 32, "mask", lone)]) == [lone]


def test_a_quorum_on_the_first_checkpoint_that_holds_it_counts_after_the_log_grew(
    tmp_path: Path,
) -> None:
    """Sites that found their quorum on a checkpoint stop cosigning; when the log grows after
    it, a site still waiting must not need a quorum on the newest checkpoint: the one it first
    found its statement in, cosigned by a quorum meanwhile, is enough."""
    coordinator = _coordinator(tmp_path / "server")
    plan = _plan()
    plan_sha = coordinator.publish_plan(plan.round_id, plan.SerializeToString())
    witness, other = _witness(tmp_path), _witness(tmp_path, "site-2")
    publication = _publication(witness, coordinator.call, plan, plan_sha)
    publication.start(SURVIVORS)
    held = int(coordinator.log.checkpoint().signed.checkpoint.size)
    polls = 0

    def growing(what: str, request: Any) -> Any:
        nonlocal polls
        if what == "GetCheckpoint" and not request.size:
            polls += 1
            if polls == 2:  # site-2 cosigns the checkpoint site-1 first saw; then the log grows
                coordinator.caller = "site-2"
                other.witness(coordinator.call)
                coordinator.caller = "site-1"
                coordinator.publish_plan("r2-later", b"another plan")
        return coordinator.call(what, request)

    assert publication.statements is not None
    problem, found = witness.quorum_problem(
        growing,
        statement=publication.statements.opening,
        what="the opening",
        wait_s=60,
        poll_s=0.01,
        max_poll_s=0.05,
    )
    assert problem == "" and found is not None
    assert int(found.checkpoint.size) == held < coordinator.store.log_size()
    assert {c.witness for c in found.cosignatures} >= {"site-1", "site-2"}


def test_a_round_counts_over_the_survivors_its_openings_state_whoever_signed() -> None:
    """Every distinct release of the openings counts once, over the survivors it states,
    whoever signed it (a masked sum holds every survivor's input, a CKKS sum every participant's
    ciphertext, opened or not), and as known before only when every stated survivor signed it
    (M-233)."""
    plan = _plan()
    release = release_fields(plan, survivors=SURVIVORS)

    def opened(mode: str, *sites: str) -> list[Opened]:
        return [Opened(s, "aa" * 32, mode, release) for s in sites]

    for mode in ("mask", "ckks"):
        two = opened(mode, "site-1", "site-2")
        assert counted_releases(two) == [release]
        assert witnessed_releases(two) == []
        every = opened(mode, *SURVIVORS)
        assert counted_releases(every) == [release] == witnessed_releases(every)
        assert counted_releases([*every, *every]) == [release]
    # the same release in two modes is two statements (a mode is part of what was signed)
    assert len(counted_releases([*opened("mask", "site-1"), *opened("ckks", "site-1")])) == 2


def _site_audit(
    opened: list[Opened], statements: list[Any], plan: cpb.ReleasePlan, *, min_cohort: int
) -> str:
    """The whole-history audit of ``plan`` as :meth:`ClientDaemon._whole_history` composes it
    for a site with no masked rounds of its own: every release the log states and every
    opening counted (:func:`counted_releases`), the openings as the signed part, the witnessed
    ones as known before."""
    counted = [("release", r) for r in counted_releases(opened)]
    problem, _ = whole_history_problem(
        plan,
        rounds=logged_rounds([*statements, *counted]),
        known=logged_rounds(("release", r) for r in witnessed_releases(opened)),
        signed=logged_rounds(counted),
        min_cohort=min_cohort,
    )
    return problem


def test_a_participant_that_uploads_without_opening_hides_itself_from_a_decrypted_ckks_sum() -> (
    None
):
    """Review of 861eb95 (malicious coordinator, one colluding participant C): the CKKS round
    r1 over {H, C, A1, A2} is decrypted (every participant's tags and ciphertext are in the sum,
    which the decryptor checks), but C uploaded without logging an opening; the coordinator
    aborts r1 after the decryption (no release statement) or states it over {H, A1, A2} (CKKS
    members check no survivors, M-230). Every audit counts r1 over its openers {H, A1, A2}, so
    the plan r2 over {C, A1, A2} adds no exposure; yet the two real sums give H's statistics to
    anyone who holds them: G(H C A1 A2) - G(C A1 A2) = G(H). Counting r1 over every participant
    its openings state (as db29bb1 did) refuses r2."""
    sites = ("H", "C", "A1", "A2")
    r1 = _plan_over("r1", sites)
    r1.aggregation = cpb.AGGREGATION_MODE_CKKS
    release = release_fields(r1, survivors=sites)  # what every opening of r1 states
    opened = [Opened(s, "aa" * 32, "ckks", release) for s in ("H", "A1", "A2")]
    r2 = _plan_over("r2", ("C", "A1", "A2"))
    # the oracle: the two real sums, on generated Gram matrices
    rng = np.random.default_rng(7)
    gram = {s: (lambda x: x.T @ x)(rng.normal(size=(6, 3))) for s in sites}
    real_r1, real_r2 = sum(gram[s] for s in sites), sum(gram[s] for s in ("C", "A1", "A2"))
    assert np.allclose(real_r1 - real_r2, gram["H"])
    aborted: list[Any] = []
    misstated = [_released("r1", sites, ("H", "A1", "A2"))]
    for statements in (aborted, misstated):
        problem = _site_audit(opened, statements, r2, min_cohort=3)
        assert "would expose" in problem and "H" in problem, problem


def test_a_ckks_site_lost_before_its_opening_does_not_stop_every_later_plan() -> None:
    """Review of 861eb95 (liveness, no attacker needed): the CKKS round r1 over {1, 2, 3}
    (min_cohort 3) aborts because site-3 is lost before its opening (a crash, or one malicious
    site that never opens); sites 1 and 2 had logged theirs. r1 was never decrypted, but every
    audit counts it over its openers {1, 2}: a sum of a group below min_cohort that the
    signed history determines and the witnessed history (empty) does not. Each later plan is
    then refused for it: r1 again over {1, 2, 3} once site-3 is back, or a plan over sites
    that never took part in r1, so the federation never publishes again. (Before 861eb95 r1
    counted over {1, 2, 3}: no such group.)"""
    sites = ("site-1", "site-2", "site-3")
    r1 = _plan_over("r1", sites)
    r1.aggregation = cpb.AGGREGATION_MODE_CKKS
    release = release_fields(r1, survivors=sites)
    opened = [Opened(s, "aa" * 32, "ckks", release) for s in sites[:2]]
    for later in (sites, ("site-4", "site-5", "site-6")):
        problem = _site_audit(opened, [], _plan_over("r2", later), min_cohort=3)
        assert problem == "", (later, problem)


def _decrypting(key: Any, *, decryptor: str, round_id: str) -> tuple[str, dict[str, object]]:
    digest = bytes(32)
    signature = sign_fields(
        key,
        context=DECRYPTING_CONTEXT,
        fields=decrypting_signed_fields(
            federation=FED, decryptor=decryptor, round_id=round_id, plan_sha256=digest
        ),
    )
    entry = decrypting_statement(
        federation=FED, decryptor=decryptor, round_id=round_id, plan_sha256=digest,
        signature=signature,
    )  # fmt: skip
    return decode_statement(entry, federation=FED)


def test_a_ckks_round_aborted_and_never_decrypted_does_not_stop_the_re_plan_without_its_lost_site() -> (
    None
):
    """M-235: the CKKS round r1 over {1, 2, 3, 4} aborts during its uploads (site-4 lost after
    every participant logged its opening). Counted over every participant, r1 and the re-plan
    r2 over {1, 2, 3} would difference to site-4, so r2 was refused until site-4 came back. The
    decryptor logs a `decrypting` statement, in a quorum checkpoint, before it decrypts any
    sum, and refuses a round the log records as aborted before it: a round the log records as
    aborted with no such statement, whose abort the decryptor has cosigned, was never decrypted
    and never will be, and r2 passes. Until the decryptor cosigned the abort, r1 counts. With
    the decryptor's statement (r1 was decrypted, then aborted), or without the abort (r1 may
    still be decrypted), r2 is refused naming site-4; a statement the decryptor did not sign,
    or one signed for another round, does not count as a decryption."""
    sites = ("site-1", "site-2", "site-3", "site-4")
    decryptor = generate_identity_key()
    keys = {
        **{s: generate_identity_key().public_key() for s in sites},
        "dec": decryptor.public_key(),
    }
    r1 = _plan_over("r1", sites)
    r1.aggregation = cpb.AGGREGATION_MODE_CKKS
    release = release_fields(r1, survivors=sites)
    opened = [Opened(s, "aa" * 32, "ckks", release) for s in sites]
    r2 = _plan_over("r2", sites[:3])
    aborted = ("round-aborted", {"round_id": "r1", "reason": "site-4 was lost"})

    def audit(statements: list[Any], *, seen: int | None = None) -> str:
        """The audit of r2 when the decryptor cosigned a checkpoint of the first ``seen``
        statements (all of them by default)."""
        aborts = undecrypted_aborts(statements, federation=FED, decryptor="dec", keys=keys)
        covered = len(statements) if seen is None else seen
        dead = never_decrypted(aborts, seen_by_decryptor=covered)
        alive = [o for o in opened if o.mode != "ckks" or o.release["round_id"] not in dead]
        return _site_audit(alive, [], r2, min_cohort=1)

    assert audit([aborted]) == ""
    forged = _decrypting(generate_identity_key(), decryptor="dec", round_id="r1")
    elsewhere = _decrypting(decryptor, decryptor="dec", round_id="r9")
    assert audit([aborted, forged, elsewhere]) == ""
    decrypted = _decrypting(decryptor, decryptor="dec", round_id="r1")
    refusals: tuple[tuple[list[Any], int | None], ...] = (
        ([decrypted, aborted], None),
        ([aborted, decrypted], None),
        ([], None),
        # the decryptor has not cosigned a checkpoint that holds the abort (a fork shown to
        # the sites, or a log it may yet see without the abort after a restore): r1 counts
        ([aborted], 0),
        ([elsewhere, aborted], 1),
    )
    for statements, seen in refusals:
        problem = audit(statements, seen=seen)
        assert "would expose" in problem and "site-4" in problem, (statements, seen, problem)
    assert audit([elsewhere, aborted], seen=2) == ""
    # no pinned decryptor (or no key for it): every opening counts
    assert undecrypted_aborts([aborted], federation=FED, decryptor=None, keys=keys) == {}
    assert undecrypted_aborts([aborted], federation=FED, decryptor="other", keys=keys) == {}
