"""The site's ``mask`` mode: pairwise masking with drop-out recovery (Bonawitz et al. CCS'17;
docs/protocol.md §4.2, docs/architecture.md §4).

The site runs :class:`afl.crypto.secagg.client.SecAggClient` over the coordinator's MASK RPCs:

    AdvertiseKeys -> (ShareKeys stage) GetAdvertisedKeys, ShareKeys -> (UPLOAD) GetSharedKeys,
    Upload of y_{u,R} per release -> (CONSISTENCY_CHECK) GetSurvivors, ConsistencyCheck ->
    (UNMASK) GetUnmaskRequest, Unmask

Every server message is checked against the SIGNED plan (the protocol config, including the
config digest bound into every signature, is derived from the plan and the SHA-256 of its signed
bytes alone by :func:`afl.proto.wire.round_config_from_plan`: a peer's advert or consistency
signature made under another plan, another roster digest included, does not verify, M-223) and
the client's own state by the state machine:
peers' adverts and consistency signatures are verified with the identity keys of the startup
kit ([peers]), never keys the server sends; the client refuses an unmask request that asks for
both shares of one peer, names non-survivors, lacks t signatures, or requests a release below its
t_R or the site's own floor (``RoundSession.survivor_floors``: min cohort whatever the plan
says). Values outside a release's declared bound are an error (never clipped). Only masked uint64
vectors leave the site.

With a sparse graph (docs/protocol.md §4.2 "Sparse graph") the site first fetches every
participant's graph commitment (``GetGraphCommitments``) and checks each one's plan-decision
signature with the kit's key of that site and the plan digest it accepted; only then does it
reveal the nonce it committed to (:attr:`RoundSession.graph_nonce`) in its advert, and the state
machine derives its neighbourhood from every participant's reveal.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.client.daemon.transport import DaemonError
from afl.client.modes.base import RoundSession, UploadRecord, upload_record
from afl.client.payloads.stats import PayloadError, SlotPayload, encode_float64
from afl.client.policy.plan import mask_threshold_problem
from afl.core.row_bounds import next_power_of_two
from afl.crypto.errors import CryptoError
from afl.crypto.identity.signatures import load_public_key_raw, verify_fields
from afl.crypto.identity.signed_blobs import PLAN_DECISION_CONTEXT, plan_decision_fields
from afl.crypto.secagg.client import SecAggClient
from afl.crypto.secagg.messages import ConsistencyRequest
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = ["MASK_STEPS", "MaskMode", "MaskStep"]


class MaskMode:
    """Client side of ``aggregation = "mask"`` (module docstring)."""

    name: str = "mask"
    aggregation: int = int(cpb.AGGREGATION_MODE_MASK)
    first_stage: int = int(pb.ROUND_STAGE_ADVERTISE_KEYS)

    def encode(self, release: cpb.Release, values: NDArray[np.float64]) -> bytes:
        """The site's float64 values, kept locally until masked (checked against the bound)."""
        enc = release.encoding
        if enc.dtype != cpb.DTYPE_UINT64_LE or enc.WhichOneof("scheme") != "fixed_point":
            raise PayloadError(f"release {release.name}: MASK mode needs uint64 fixed point")
        bound = enc.fixed_point.bound
        if not np.all(np.isfinite(values)):
            raise PayloadError(f"release {release.name}: statistics contain NaN or inf")
        worst = float(np.max(np.abs(values))) if values.size else 0.0
        if worst > bound:
            raise PayloadError(_bound_advice(release, bound=bound, worst=worst))
        return encode_float64(values)

    def exchange(
        self,
        session: RoundSession,
        payloads: Sequence[SlotPayload],
        *,
        already_complete: Collection[str] = (),
    ) -> list[UploadRecord]:
        if already_complete:
            raise DaemonError("a masked round cannot be resumed after its uploads (keys are lost)")
        client = self.secagg_client(session, payloads)
        try:
            return self._run(session, client)
        except CryptoError as exc:  # the state machine refused a server message
            raise DaemonError(f"masked exchange refused: {exc}") from exc

    @staticmethod
    def _run(session: RoundSession, client: SecAggClient) -> list[UploadRecord]:
        rpc, rid = session.rpc, session.round_id
        sent: list[UploadRecord] = []
        for step in MASK_STEPS:
            answer = None
            start = time.perf_counter()
            if step.get:
                rpc.await_stage(rid, at_least=step.stage, stage_only=True)
                answer = rpc.call(step.get, cpb.RoundRef(round_id=rid))
            got = time.perf_counter()
            sent += step.act(session, client, answer)
            name = step.act.__name__.lstrip("_")  # advertise, share_keys, masked_input, ...
            session.timings[f"mask_{name}_wait"] = got - start
            session.timings[f"mask_{name}"] = time.perf_counter() - got
        return sent

    @staticmethod
    def secagg_client(session: RoundSession, payloads: Sequence[SlotPayload]) -> SecAggClient:
        """The protocol state machine of this site's round, its thresholds checked against the
        site's floors again (:func:`afl.client.policy.plan.mask_threshold_problem`)."""
        problem = mask_threshold_problem(session.plan, floors=dict(session.survivor_floors))
        if problem:  # checked with the plan already (policy.check_plan); again before any key
            raise DaemonError(problem)
        if len(session.plan_sha256) != 32:
            raise DaemonError(
                "a masked round needs the SHA-256 of the signed plan this site accepted: every "
                "advert and consistency signature binds it"
            )
        config = wire.round_config_from_plan(session.plan, plan_sha256=session.plan_sha256)
        if config.graph is not None and not session.graph_nonce:
            raise DaemonError(
                "a sparse-graph round needs the graph nonce this site committed to when it "
                "accepted the plan, and it is gone (the site restarted after accepting)"
            )
        identities = _peer_identities(session.peer_keys, config.cohort)
        inputs = {  # views of the payload bytes (the state machine encodes them at once)
            name: np.frombuffer(item.payload, dtype="<f8")
            for item in payloads
            for name in item.releases
        }
        try:
            return SecAggClient(
                site_id=session.site_id,
                identity_key=session.identity_key,
                config=config,
                identities=identities,
                inputs=inputs,
                survivor_floors=session.survivor_floors,
                graph_nonce=session.graph_nonce if config.graph is not None else None,
            )
        except CryptoError as exc:
            raise DaemonError(f"cannot mask this site's statistics: {exc}") from exc


def _send(session: RoundSession, method: str, slot: str, message: Any) -> UploadRecord:
    start = time.perf_counter()
    session.rpc.call(method, message)
    elapsed = time.perf_counter() - start
    return UploadRecord(slot, (), message.ByteSize(), "", 1, False, False, elapsed)


def _advertise(session: RoundSession, client: SecAggClient, _: Any) -> list[UploadRecord]:
    commitments = _graph_commitments(session) if client.config.graph is not None else None
    advert = wire.advert_to_proto(client.advertise_keys(commitments))
    return [_send(session, "AdvertiseKeys", "mask/advertise-keys", advert)]


def _share_keys(session: RoundSession, client: SecAggClient, keys: Any) -> list[UploadRecord]:
    shares = client.share_keys(wire.directory_from_proto(keys))
    return [_send(session, "ShareKeys", "mask/share-keys", wire.share_keys_to_proto(shares))]


def _masked_input(session: RoundSession, client: SecAggClient, shared: Any) -> list[UploadRecord]:
    masked = client.masked_input(wire.routed_from_proto(shared, recipient=session.site_id))
    return [
        upload_record(session, name, (name,), np.ascontiguousarray(y, dtype="<u8").tobytes())
        for name, y in masked.vectors
    ]


def _consistency(session: RoundSession, client: SecAggClient, listed: Any) -> list[UploadRecord]:
    survivors = tuple(listed.survivors)
    opening = b""  # the site's opening, logged by the coordinator before it keeps the signature
    if session.survivors_check is not None:  # before the signature and any unmask share
        opening = session.survivors_check(survivors)
    signed = client.consistency_check(ConsistencyRequest(session.round_id, survivors))
    message = pb.ConsistencySignature(
        round_id=session.round_id,
        survivors=list(survivors),
        signature=signed.signature,
        opening=opening,
    )
    return [_send(session, "ConsistencyCheck", "mask/consistency-check", message)]


def _unmask(session: RoundSession, client: SecAggClient, request: Any) -> list[UploadRecord]:
    if session.before_unmask is not None:  # the opening is in the log first (M-232)
        session.before_unmask()
    response = client.unmask(wire.unmask_request_from_proto(request))
    return [_send(session, "Unmask", "mask/unmask", wire.unmask_response_to_proto(response))]


@dataclass(frozen=True)
class MaskStep:
    """One stage of the site's masked exchange: once the round reaches ``stage``, read the
    server's message of that stage with ``get`` (a RoundRef request), then ``act`` on it and send
    this site's message (the first step needs nothing from the server: no ``get``)."""

    stage: int
    get: str
    act: Callable[[RoundSession, SecAggClient, Any], list[UploadRecord]]


#: The site's side of the masked exchange, in order (module docstring).
MASK_STEPS: tuple[MaskStep, ...] = (
    MaskStep(pb.ROUND_STAGE_ADVERTISE_KEYS, "", _advertise),
    MaskStep(pb.ROUND_STAGE_SHARE_KEYS, "GetAdvertisedKeys", _share_keys),
    MaskStep(pb.ROUND_STAGE_UPLOAD, "GetSharedKeys", _masked_input),
    MaskStep(pb.ROUND_STAGE_CONSISTENCY_CHECK, "GetSurvivors", _consistency),
    MaskStep(pb.ROUND_STAGE_UNMASK, "GetUnmaskRequest", _unmask),
)


def _bound_advice(release: cpb.Release, *, bound: float, worst: float) -> str:
    """The refusal (values are never clipped) with the server.toml value that would fit. It goes
    to the coordinator in the site's report, so it names the magnitude only as the next power of
    two (as much as a declared row bound says, docs/protocol.md §4.2), never the value itself."""
    need = next_power_of_two(worst)
    if release.kind == cpb.STATISTIC_KIND_GRAM:
        fix = f"set [round] mask_gram_bound = {need:.6g} or more"
    elif release.kind in (cpb.STATISTIC_KIND_CLASS_VECTOR, cpb.STATISTIC_KIND_PSEUDO_CLASS_VECTOR):
        fix = f"set [round] mask_vector_bound = {need:.6g} or more"
    elif release.kind in wire.EVALUATION_KINDS:  # counts of the evaluated rows
        fix = f"set [round] eval_max_rows = {need:.6g} or more (this site's evaluated rows)"
    else:  # DP statistics: bounded through N (docs/protocol.md §7)
        fix = "raise [round] mask_max_samples to at least this site's number of rows"
    return (
        f"release {release.name}: a value exceeds the plan's bound {bound:.6g} (it needs up to "
        f"{need:.6g}); values are never clipped: in server.toml {fix}, or set the mask_* bounds "
        "to 0 so that each site declares its own at enrolment"
    )


def _graph_commitments(session: RoundSession) -> dict[str, bytes]:
    """Every participant's graph commitment, each checked against its plan-decision signature
    with the kit's identity key of that site and this plan's digest (never the server's word)."""
    listed = session.rpc.call("GetGraphCommitments", cpb.RoundRef(round_id=session.round_id))
    participants = set(session.plan.participants)
    out: dict[str, bytes] = {}
    for item in listed.commitments:
        site = item.site_id
        if site not in participants or site in out or site not in session.peer_keys:
            raise DaemonError(f"graph commitments: unknown or repeated site {site!r}")
        if item.plan_sha256 != session.plan_sha256:
            raise DaemonError(f"the graph commitment of {site} is for another plan")
        try:
            verify_fields(
                load_public_key_raw(session.peer_keys[site]),
                item.signature,
                context=PLAN_DECISION_CONTEXT,
                fields=plan_decision_fields(
                    round_id=session.round_id,
                    accept=True,
                    plan_sha256=session.plan_sha256,
                    graph_commitment=bytes(item.commitment),
                ),
            )
        except CryptoError as exc:
            raise DaemonError(f"the graph commitment of {site} is not signed by {site}") from exc
        out[site] = bytes(item.commitment)
    return out


def _peer_identities(peers: Mapping[str, bytes], cohort: Sequence[str]) -> dict[str, Any]:
    """Identity keys of the cohort from the startup kit; a site the kit does not know is refused."""
    unknown = sorted(set(cohort) - set(peers))
    if unknown:
        raise DaemonError(
            f"the startup kit has no identity key for {unknown}; cannot verify their signatures"
        )
    return {s: load_public_key_raw(peers[s]) for s in cohort}
