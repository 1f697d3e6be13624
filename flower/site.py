"""The site's side of the Flower app: afl-client's round, one step per Flower message
(docs/flower.md §3 lists the steps; docs/architecture.md §3 the round at a site).

:class:`FlowerSite` is the site daemon and :class:`FlowerDecryptor` the CKKS decryptor daemon,
both taking part through the relay's messages instead of their own gRPC calls, with one template
of a step (:class:`FlowerSteps`). Calls go through the daemons' own code with a
:class:`RelayStub` in place of the gRPC stub: requests are recorded for the reply; reads are
answered from what came with this message (the previous step asked for them, with the gate that
said when); results — refusals, the enrolment reply, upload receipts — come with the next message
(:func:`check_results`). Between messages the site keeps a :class:`Session`, sealed
(:mod:`afl.flower.session`); :func:`open_site` opens either site from a client.toml.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError, Message

from afl.client.config import ClientConfig
from afl.client.daemon.decryptor import DecryptorDaemon
from afl.client.daemon.loop import ClientDaemon
from afl.client.daemon.report import RoundReport
from afl.client.daemon.rpc import CoordinatorClient, RoundFailed, check_enrolment
from afl.client.daemon.state import plan_summary
from afl.client.daemon.transport import (
    DaemonError,
    RemoteCallError,
    RetryPolicy,
    UploadError,
    check_receipt,
    check_round_id,
)
from afl.client.daemon.verify import VerificationError, verify_round_config
from afl.client.modes.base import AggregationMode, RoundSession
from afl.client.modes.mask import MASK_STEPS, MaskMode
from afl.client.payloads.evaluation import is_evaluation_plan
from afl.client.policy.plan import PolicyDecision
from afl.crypto.errors import CryptoError
from afl.crypto.secagg.client import SecAggClient
from afl.flower.envelope import Answer, Call, FromSite, Gate, ToSite, Value, job_key, to_site
from afl.flower.session import SessionError, open_session, seal_session
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = [
    "FlowerDecryptor",
    "FlowerSite",
    "FlowerSteps",
    "RelayStub",
    "Session",
    "check_results",
    "handle",
    "open_site",
    "within_the_app",
]

log = logging.getLogger("afl.flower.site")

_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
#: Reads: answered from the message (the previous reply asked for them).
ANSWERED = frozenset(
    {
        "GetEnrolChallenge",
        "GetStatus",
        "GetRoundConfig",
        "GetAdvertisedKeys",
        "GetSharedKeys",
        "GetSurvivors",
        "GetConsistencySignatures",
        "GetUnmaskRequest",
        "GetCkksContext",
        "GetAggregateTags",
        "GetDecryptionJobs",
        "GetModel",
        "Download",
    }
)


#: A step's answer: the gate of the next message and the reads to answer with it.
Next = tuple[Gate, tuple[Call, ...]]


def _response_class(method: str) -> type[Message]:
    cls: type[Message] = message_factory.GetMessageClass(
        _SERVICE.methods_by_name[method].output_type
    )
    return cls


def remote_error(method: str, error: str) -> RemoteCallError:
    """The daemon's error for a call the coordinator refused (``"<status>: <reason>"``)."""
    name, _, details = error.partition(": ")
    code = grpc.StatusCode[name] if name in grpc.StatusCode.__members__ else None
    return RemoteCallError(method, code, details or error)


def get(method: str, request: Message) -> Call:
    """A read for the next message."""
    return Call(method, request.SerializeToString())


class RelayStub:
    """A Coordinator stub for the daemon's code (module docstring): ``calls`` are the requests
    to send with the reply, ``uploads`` (release, SHA-256, size) what each Upload carried.
    ``Enroll`` is answered with ``enrolment`` (the kit's own values) until the coordinator's
    reply comes with the next message, where it is checked."""

    def __init__(self, answers: Sequence[Answer], *, enrolment: pb.EnrollResponse) -> None:
        self._answers = {(a.method, a.request): a for a in answers}
        self._enrolment = enrolment
        self.calls: list[Call] = []
        self.uploads: list[tuple[str, bytes, int]] = []

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_") or method not in _SERVICE.methods_by_name:
            raise AttributeError(method)

        def call(request: Any, **_: Any) -> Any:
            return self._call(method, request)

        return call

    def _call(self, method: str, request: Any) -> Any:
        if method == "Upload":
            return self._upload(list(request))
        if method in ANSWERED:
            return self._answer(method, request)
        self.calls.append(Call(method, request.SerializeToString()))
        if method == "Enroll":
            return self._enrolment
        return _response_class(method)()

    def _answer(self, method: str, request: Message) -> Any:
        answer = self._answers.get((method, request.SerializeToString()))
        if answer is None:
            raise DaemonError(f"{method}: the coordinator's message carries no answer to it")
        if answer.error:
            raise remote_error(method, answer.error)
        cls = _response_class(method)
        try:
            messages = [cls.FromString(r) for r in answer.response]
        except DecodeError as exc:
            raise DaemonError(f"{method}: the answer does not parse") from exc
        if method == "Download":
            return iter(messages)
        if len(messages) != 1:
            raise DaemonError(f"{method}: expected one answer, got {len(messages)}")
        return messages[0]

    def _upload(self, chunks: list[pb.UploadChunk]) -> pb.UploadReceipt:
        self.calls += [Call("Upload", c.SerializeToString()) for c in chunks]
        data = b"".join(c.data for c in chunks)
        digest = hashlib.sha256(data).digest()
        name = chunks[0].release_name if chunks else ""
        self.uploads.append((name, digest, len(data)))
        # What the coordinator received is checked against this with the next message.
        return pb.UploadReceipt(
            round_id=chunks[0].round_id if chunks else "",
            release_name=name,
            sha256=digest,
            bytes_received=len(data),
        )


@dataclass
class Session:
    """What the site keeps between messages (sealed, :mod:`afl.flower.session`)."""

    step: str = "hello"
    enrolled: bool = False
    done: list[str] = field(default_factory=list)
    round_id: str = ""
    config: bytes = b""
    floors: dict[str, int] = field(default_factory=dict)
    report: RoundReport | None = None
    started: float = 0.0
    exchange_started: float = 0.0
    sent: list[tuple[str, bytes, int]] = field(default_factory=list)
    mask_step: int = 0
    secagg: SecAggClient | None = None


def _report(session: Session) -> RoundReport:
    """The report of the round ``session`` takes part in (made when its plan came)."""
    if session.report is None:
        raise DaemonError("the session holds no report of its round")
    return session.report


def _next_round(session: Session) -> Next:
    session.step = "plan"
    gets = (get("GetStatus", pb.StatusRequest()), get("GetRoundConfig", cpb.RoundRef()))
    return Gate("round", done=tuple(session.done)), gets


def _await(rid: str, stage: int, *reads: Call) -> Next:
    return Gate("stage", rid, stage), (get("GetStatus", pb.StatusRequest(round_id=rid)), *reads)


def _response(result: Answer) -> bytes:
    if len(result.response) != 1:
        raise DaemonError(f"{result.method}: expected one reply, got {len(result.response)}")
    return result.response[0]


def check_results(message: ToSite, session: Session, config: ClientConfig) -> None:
    """The results of the site's previous calls (module docstring): the enrolment reply checked
    against the kit, each upload receipt against what was sent; the first refusal raised. A
    result the message should carry and does not (the enrolment reply, a receipt) fails the
    check: what the coordinator received is never taken on trust."""
    sent, session.sent = session.sent, []
    refused: list[Answer] = []
    for result in message.results:
        if result.method == "Upload":
            if not sent:
                raise UploadError("a receipt for an upload this site did not send")
            name, digest, size = sent.pop(0)
            if not result.error:
                receipt = pb.UploadReceipt.FromString(_response(result))
                check_receipt(receipt, release_name=name, sha256=digest, size=size)
        if result.method == "SubmitReport":
            if result.error:
                log.warning("site=%s could not submit its report: %s", config.site_id, result.error)
            continue
        if result.error:
            refused.append(result)
            continue
        if result.method == "Enroll" and not session.enrolled:
            check_enrolment(
                pb.EnrollResponse.FromString(_response(result)),
                site_id=config.site_id,
                federation_id=config.federation_id,
                server_public_key=config.server_public_key,
            )
            session.enrolled = True
    if refused:
        raise remote_error(refused[0].method, refused[0].error)
    if not session.enrolled:
        raise DaemonError("the coordinator's message carries no reply to this site's Enroll")
    if sent:
        raise UploadError(f"upload {sent[0][0]}: the coordinator's message carries no receipt")


def _relay_client(
    message: ToSite, config: ClientConfig, retry: RetryPolicy
) -> tuple[RelayStub, CoordinatorClient]:
    """The daemon's coordinator client over a :class:`RelayStub` answering from ``message``;
    ``Enroll`` returns the kit's own values at once (the reply is checked with the next
    message)."""
    enrolment = pb.EnrollResponse(
        site_id=config.site_id,
        federation_id=config.federation_id,
        server_identity_public_key=config.server_public_key,
    )
    stub = RelayStub(message.answers, enrolment=enrolment)
    return stub, CoordinatorClient(stub, site_id=config.site_id, timing=config.timing, retry=retry)


def _foreign(message: ToSite, config: ClientConfig) -> bool:
    """Whether the coordinator serves another federation than the kit's (logged)."""
    if message.federation_id == config.federation_id:
        return False
    log.error(
        "site=%s: the coordinator serves federation %r, this kit belongs to %r",
        config.site_id,
        message.federation_id,
        config.federation_id,
    )
    return True


class FlowerSteps:
    """The template of a step, for both Flower sites (module docstring): each message gets the
    daemon's coordinator client over a :class:`RelayStub`, runs the step the session is at and is
    answered with the calls the step made. ``hello`` (ask for a challenge) and ``enrol`` are
    shared, then every step first checks the results of the previous one (:func:`check_results`);
    a site fills in :meth:`_enrol`, :meth:`_next` (its own steps) and :meth:`_stop` (what an error
    ends), and which errors a step may end with (``STOPS``)."""

    config: ClientConfig
    retry: RetryPolicy
    rpc: Any  # the daemon's CoordinatorClient (the decryptor's is Optional until it connects)
    STOPS: tuple[type[Exception], ...] = (DaemonError, VerificationError, ValueError)

    def step(self, message: ToSite, session: Session) -> FromSite:
        """Run the step ``session`` is at with ``message``; the reply (module docstring)."""
        site_id = self.config.site_id
        stub, self.rpc = _relay_client(message, self.config, self.retry)
        if _foreign(message, self.config):
            return FromSite(site_id, (), Gate("end"), ())
        try:
            gate, gets = self._dispatch(message, session)
        except self.STOPS as exc:
            gate, gets = self._stop(exc, session)
        session.sent += stub.uploads
        return FromSite(site_id, tuple(stub.calls), gate, gets)

    def _dispatch(self, message: ToSite, session: Session) -> Next:
        if session.step == "hello":
            session.step = "enrol"
            return Gate("now"), (get("GetEnrolChallenge", pb.EnrolChallengeRequest()),)
        if session.step == "enrol":
            return self._enrol(session)
        if session.step == "end":
            return Gate("end"), ()
        check_results(message, session, self.config)
        return self._next(session)

    def _enrol(self, session: Session) -> Next:
        """Enrol (its reply is checked with the next message); the next gate."""
        raise NotImplementedError

    def _next(self, session: Session) -> Next:
        """The site's own step ``session.step``, the previous results checked."""
        raise NotImplementedError

    def _stop(self, exc: Exception, session: Session) -> Next:
        """What ``exc``, raised by a step, ends; the next gate."""
        raise NotImplementedError


class FlowerSite(ClientDaemon, FlowerSteps):
    """A site taking part in rounds through Flower messages (module docstring)."""

    anchors_ledger = False  # the relay carries no federation log (docs/protocol.md §11a)

    def __init__(self, config: ClientConfig) -> None:
        if config.role != "participant":
            raise DaemonError(f"{config.path}: role = {config.role!r}; FlowerSite is a participant")
        super().__init__(config)
        self.prepare()

    def _enrol(self, session: Session) -> Next:
        self.enroll()
        return _next_round(session)

    def _stop(self, exc: Exception, session: Session) -> Next:
        if not session.round_id:  # enrolment failed: no round to report
            log.error("site=%s cannot take part: %s", self.site_id, exc)
            session.step = "end"
            return Gate("end"), ()
        return self._end_round(session, self._failure(exc, session))

    def _next(self, session: Session) -> Next:
        if session.step == "plan":
            return self._plan(session)
        status = self.rpc.status(session.round_id).round
        if status.stage == pb.ROUND_STAGE_ABORTED:
            raise RoundFailed(pb.CLIENT_OUTCOME_ABORTED, f"round aborted: {status.abort_reason}")
        if session.step == "exchange":
            return self._exchange(session, status)
        if session.step == "mask":
            return self._mask(session)
        if session.step == "model":
            return self._model_step(session)
        raise DaemonError(f"unknown step {session.step!r} in the session")

    def _failure(self, exc: Exception, session: Session) -> RoundFailed:
        """A refused call is an abort when the round was aborted meanwhile (as in the daemon)."""
        if isinstance(exc, RoundFailed):
            return exc
        if isinstance(exc, RemoteCallError):
            try:
                status = self.rpc.status(session.round_id).round
            except DaemonError:
                status = None
            if status is not None and status.stage == pb.ROUND_STAGE_ABORTED:
                return RoundFailed(
                    pb.CLIENT_OUTCOME_ABORTED, f"round aborted: {status.abort_reason}"
                )
        return RoundFailed(pb.CLIENT_OUTCOME_FAILED, str(exc))

    def _end_round(self, session: Session, failed: RoundFailed) -> Next:
        """Report the round's end as the daemon does: aborted, the site waits for the next round
        (the replacement); refused or failed, it takes part in nothing more of this run."""
        self._finish(_report(session), failed.outcome, failed.reason)
        session.secagg, session.round_id = None, ""
        if failed.outcome == pb.CLIENT_OUTCOME_ABORTED:
            return _next_round(session)  # the replacement round, if one opens
        session.step = "end"
        return Gate("end"), ()

    # --- the round ------------------------------------------------------------------------------

    def _round(
        self, session: Session
    ) -> tuple[pb.RoundConfig, cpb.ReleasePlan, bytes, AggregationMode]:
        cfg = pb.RoundConfig.FromString(session.config)
        plan, plan_sha = verify_round_config(
            cfg, server_key=self.server_key, federation_id=self.config.federation_id
        )
        return cfg, plan, plan_sha, self.modes[plan.aggregation]

    def _plan(self, session: Session) -> Next:
        status = self.rpc.status().round
        cfg: pb.RoundConfig = self.rpc.call("GetRoundConfig", cpb.RoundRef())
        rid = check_round_id(status.round_id)  # it names files, as in the daemon
        replay = self.store.uploads.refusal(  # the daemon's rule (afl.client.policy.uploads)
            rid,
            already_complete=status.caller_uploads_complete,
            reported=self.store.reported_rounds(),
        )
        if replay:  # a replayed round: its sums may be released
            # No report is written: the one of the round the site took part in stays on record.
            log.warning("site=%s REFUSED round %s: %s", self.site_id, rid, replay)
            session.step = "end"
            return Gate("end"), ()
        session.round_id, session.started = rid, time.time()
        session.done.append(rid)
        report = self._new_report(run_id=status.run_id, round_id=rid, round_number=cfg.round_number)
        report.bytes_received, report.transport = cfg.ByteSize(), "flower"
        session.report = report
        if cfg.round_id != rid:
            raise DaemonError(f"the round configuration is of {cfg.round_id!r}, not {rid!r}")
        decision, plan, plan_sha = self._decide(cfg, round_id=rid)
        if decision.accept and plan is not None:
            decision = within_the_app(plan, decision)
        report.plan = plan_summary(cfg, plan, decision, plan_sha)
        if status.stage == pb.ROUND_STAGE_PLAN_REVIEW or not status.caller_accepted_plan:
            self._respond(rid, decision, plan_sha)
        report.timings_s["plan_check"] = time.time() - session.started
        if not decision.accept:
            log.warning("site=%s REFUSED round %s: %s", self.site_id, rid, decision.reason)
            raise RoundFailed(pb.CLIENT_OUTCOME_REFUSED_PLAN, decision.reason)
        assert plan is not None
        self.store.remember(plan)
        session.config, session.floors = cfg.SerializeToString(), dict(decision.survivor_floors)
        mode = self.modes[plan.aggregation]
        reads = [get("GetModel", pb.ModelRequest(round_id=cfg.parent_round_id))]
        reads = reads if cfg.parent_round_id else []
        if mode.name == "ckks":  # what CkksMode.exchange reads (fetch_public_context)
            reads.append(get("GetCkksContext", cpb.RoundRef(round_id=rid)))
            context = pb.DownloadRequest(round_id=rid, kind=pb.PAYLOAD_KIND_CKKS_PUBLIC_CONTEXT)
            reads.append(get("Download", context))
        session.step = "exchange"
        return _await(rid, mode.first_stage, *reads)

    def _session(self, session: Session, plan: cpb.ReleasePlan, plan_sha: bytes) -> RoundSession:
        return self.round_session(
            session.round_id, plan=plan, plan_sha256=plan_sha, survivor_floors=session.floors
        )

    def _exchange(self, session: Session, status: pb.RoundStatus) -> Next:
        cfg, plan, plan_sha, mode = self._round(session)
        report = _report(session)
        report.timings_s["wait_upload_stage"] = time.time() - session.started
        payloads = self.payloads(cfg, plan, mode, report)
        self._record(cfg, plan, plan_sha, report)  # the ledger, before any upload leaves
        payloads = self._claim(cfg, plan, plan_sha, payloads, status)  # likewise the register
        session.exchange_started = time.time()
        round_session = self._session(session, plan, plan_sha)
        report.uploads = []
        if isinstance(mode, MaskMode):
            session.secagg = mode.secagg_client(round_session, payloads)
            session.mask_step, session.step = 0, "mask"
            return self._mask(session)
        records = mode.exchange(
            round_session, payloads, already_complete=set(status.caller_uploads_complete)
        )
        report.sent(records)
        self.store.uploads.finish(session.round_id)
        return self._await_model(session)

    def _mask(self, session: Session) -> Next:
        _, plan, plan_sha, _ = self._round(session)
        rid, client = session.round_id, session.secagg
        if client is None:
            raise DaemonError("a masked round cannot be resumed without its keys")
        step = MASK_STEPS[session.mask_step]
        answer = self.rpc.call(step.get, cpb.RoundRef(round_id=rid)) if step.get else None
        try:
            records = step.act(self._session(session, plan, plan_sha), client, answer)
        except CryptoError as exc:  # the state machine refused a server message
            raise DaemonError(f"masked exchange refused: {exc}") from exc
        _report(session).sent(records)
        session.mask_step += 1
        if session.mask_step == len(MASK_STEPS):
            session.secagg = None  # the round's secrets are not kept past its last message
            self.store.uploads.finish(rid)
            return self._await_model(session)
        following = MASK_STEPS[session.mask_step]
        return _await(rid, following.stage, get(following.get, cpb.RoundRef(round_id=rid)))

    def _await_model(self, session: Session) -> Next:
        session.step = "model"
        rid = session.round_id
        return _await(rid, pb.ROUND_STAGE_PUBLISHED, get("GetModel", pb.ModelRequest(round_id=rid)))

    def _model_step(self, session: Session) -> Next:
        cfg, _, plan_sha, _ = self._round(session)
        report = _report(session)
        report.timings_s["upload"] = time.time() - session.exchange_started
        self.receive_model(
            session.round_id,
            class_names=list(cfg.class_names),
            plan_sha256=plan_sha,
            report=report,
        )
        report.timings_s["round"] = time.time() - session.started
        self._finish(report, pb.CLIENT_OUTCOME_COMPLETED)
        session.round_id = ""
        return _next_round(session)


def within_the_app(plan: cpb.ReleasePlan, decision: PolicyDecision) -> PolicyDecision:
    """An accepted plan the Flower app cannot carry out is refused before anything is sent:
    a sparse masking graph (its commitments need a round trip the relay does not make) and a
    run's evaluation round (its signed result is not relayed); both run through afl's own
    daemons (docs/flower.md §7)."""
    if plan.mask_graph.degree:
        reason = "the Flower app masks with the full graph; a sparse-graph plan needs afl-client"
    elif is_evaluation_plan(plan):
        reason = "the Flower app does not take part in evaluation rounds; they need afl-client"
    else:
        return decision
    return PolicyDecision(False, reason, audit=decision.audit)


class FlowerDecryptor(DecryptorDaemon, FlowerSteps):
    """The CKKS decryptor site through Flower messages: enrol and publish the public context,
    then serve each round's decryption jobs with the daemon's own code (``serve_once``: the
    signed plan checked, the sealed tags opened, each aggregate decrypted and the signed outcome
    reported). Its secret key stays in its state folder, never in the session; its ledger there
    refuses to decrypt a release twice with different inputs.

        hello    ask for an enrolment challenge
        enrol    Enroll as the decryptor, upload and announce the public context; wait for jobs
        serve    the coordinator lists jobs: ask for them, the round's sealed tags and each
                 aggregate, at once
        decrypt  ``serve_once`` on them; wait for jobs not yet handled (a ``jobs`` gate)
    """

    STOPS = (*FlowerSteps.STOPS, CryptoError)
    logs_decryption = False  # the relay carries no federation log (docs/protocol.md §11a)

    @property
    def site_id(self) -> str:
        return self.config.site_id

    def _enrol(self, session: Session) -> Next:
        self.enroll_and_publish()
        session.step = "serve"
        return _await_jobs(session)

    def _stop(self, exc: Exception, session: Session) -> Next:
        log.error("decryptor=%s stops: %s", self.site_id, exc)
        session.step = "end"
        return Gate("end"), ()

    def _next(self, session: Session) -> Next:
        jobs: pb.DecryptionJobs = self._rpc().call("GetDecryptionJobs", cpb.RoundRef())
        rid = jobs.round_id
        if session.step == "serve":
            if all(job_key(rid, j.release_name) in session.done for j in jobs.jobs):
                return _await_jobs(session)
            session.step = "decrypt"
            reads = [get("GetDecryptionJobs", cpb.RoundRef())]
            reads.append(get("GetAggregateTags", cpb.RoundRef(round_id=rid)))
            reads += [
                get(
                    "Download",
                    pb.DownloadRequest(
                        round_id=rid,
                        kind=pb.PAYLOAD_KIND_CKKS_AGGREGATE,
                        release_name=j.release_name,
                    ),
                )
                for j in jobs.jobs
            ]
            return Gate("now"), tuple(reads)
        if session.step == "decrypt":
            self.serve_once()
            session.done += [job_key(rid, j.release_name) for j in jobs.jobs]
            session.step = "serve"
            return _await_jobs(session)
        raise DaemonError(f"unknown step {session.step!r} in the decryptor's session")


def _await_jobs(session: Session) -> Next:
    return Gate("jobs", done=tuple(session.done)), (get("GetDecryptionJobs", cpb.RoundRef()),)


def open_site(config: ClientConfig) -> FlowerSite | FlowerDecryptor:
    """The site of ``config``: a participant, or the CKKS decryptor (``role``)."""
    if config.role == "decryptor":
        return FlowerDecryptor(config)
    return FlowerSite(config)


def handle(
    site: FlowerSite | FlowerDecryptor, record: Mapping[str, object], sealed: bytes | None
) -> tuple[dict[str, Value], bytes]:
    """One ClientApp invocation without Flower: decode the coordinator's record, open the
    sealed session (a fresh one for the first message), run the step, seal the session again;
    the reply's record and the new sealed session."""
    c = site.config
    session = Session()
    if sealed is not None:
        session = open_session(
            sealed, identity=site.identity, federation_id=c.federation_id, site_id=c.site_id
        )
        if not isinstance(session, Session):
            raise SessionError("the sealed session holds no afl.flower Session")
    reply = site.step(to_site(record), session)
    blob = seal_session(
        session, identity=site.identity, federation_id=c.federation_id, site_id=c.site_id
    )
    return reply.record(), blob
