"""MASK aggregation mode of the coordinator (Bonawitz et al. CCS'17; design §6; issue 5).

Once every participant accepted the signed plan, the round runs the server state machine
:class:`~afl.crypto.secagg_server.SecAggServer` through these RoundStage values, each with its
own deadline (``upload_timeout_s``); a stage closes as soon as every live site has answered, or
at its deadline with the sites that did (the others have dropped out):

    ADVERTISE_KEYS -> SHARE_KEYS -> UPLOAD (masked input) -> CONSISTENCY_CHECK -> UNMASK -> SOLVING

A stage closing with fewer than t live sites, or a release left with fewer than its t_R
surviving members, ABORTS the round with the reason and releases nothing. The decoded sums
(over the surviving members, U3) go to the same solve as the plaintext mode.

Encodings (design §6): release R is fixed-point encoded in Z_{2^64} with its declared bound B_R
(Gram: ``gram_bound``; class vectors: ``vector_bound``) and the most fractional bits f with
m_R·B_R·2^f < 2^63 (m_R members); sites reject out-of-range values with an error. The stored
uploads are the masked uint64 vectors only; the key material lives in memory, so a server
restarted mid-exchange aborts the round (nothing is released).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.packing import unpack_upper
from afl.crypto.errors import (
    DuplicateMessageError,
    ProtocolError,
    RoundAbortedError,
    StageError,
    UnknownParticipantError,
)
from afl.crypto.secagg_config import default_threshold
from afl.crypto.secagg_messages import (
    ClientMessage,
    KeyDirectory,
    RoutedShares,
    UnmaskRequest,
)
from afl.crypto.secagg_server import SecAggServer
from afl.crypto.signatures import load_public_key_raw
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import MaskSettings
from afl.server.dp_mask import dp_mask_encodings
from afl.server.errors import (
    ConflictError,
    InvalidRequestError,
    NotPermittedError,
    WrongStageError,
)
from afl.server.mask_wire import masked_upload, release_length, round_config_from_plan
from afl.server.plan import PlannedRelease

__all__ = ["MASK_STAGES", "MaskRound", "MaskStrategy"]

log = logging.getLogger("afl.server.mask")

#: RoundStage values of the masked exchange, in order.
MASK_STAGES = (
    pb.ROUND_STAGE_ADVERTISE_KEYS,
    pb.ROUND_STAGE_SHARE_KEYS,
    pb.ROUND_STAGE_UPLOAD,
    pb.ROUND_STAGE_CONSISTENCY_CHECK,
    pb.ROUND_STAGE_UNMASK,
)


@dataclass
class MaskRound:
    """In-memory state of one round's masked exchange."""

    server: SecAggServer
    lengths: dict[str, int]
    expected: set[str]
    received: dict[str, bytes] = field(default_factory=dict)  # site -> request bytes, this stage
    directory: KeyDirectory | None = None
    routed: dict[str, RoutedShares] = field(default_factory=dict)
    survivors: tuple[str, ...] | None = None
    unmask: UnmaskRequest | None = None


class MaskStrategy:
    """Server side of ``aggregation = "mask"`` (see the module docstring)."""

    name = "mask"
    proto_mode = int(cpb.AGGREGATION_MODE_MASK)

    def __init__(self, settings: MaskSettings, *, identities: Mapping[str, bytes]) -> None:
        self.settings = settings
        self._identities = {s: load_public_key_raw(k) for s, k in identities.items()}
        self.rounds: dict[str, MaskRound] = {}
        self._sums: dict[str, dict[str, NDArray[np.float64]]] = {}
        self._contributors: dict[str, tuple[str, ...]] = {}

    # --- plan --------------------------------------------------------------------------------

    def plan_options(self, participants: tuple[str, ...]) -> dict[str, Any]:
        """build_plan arguments: MASK mode, t, and each release's fixed-point encoding."""
        t = self.settings.threshold or default_threshold(len(participants))
        if not 2 <= t <= len(participants):
            raise ValueError(f"mask_threshold {t} must lie in 2..{len(participants)}")
        return {
            "aggregation": cpb.AGGREGATION_MODE_MASK,
            "encoding": self.encoding,
            "mask_threshold": t,
        }

    def encoding(self, release: PlannedRelease) -> cpb.Encoding:
        """uint64 fixed point with bound B and f = max{f : m·B·2^f < 2^63} (design §6)."""
        from afl.crypto.secagg_config import ReleaseSpec  # local: keeps the import list short

        bound = self.settings.gram_bound if release.packed else self.settings.vector_bound
        m = len(release.members)
        threshold = None if m >= 3 else m  # t_R below the minimum cohort only for tiny releases
        spec = ReleaseSpec(
            name=release.name, members=release.members, length=1, bound=bound, threshold=threshold
        )
        packing = cpb.PACKING_UPPER_TRIANGLE if release.packed else cpb.PACKING_DENSE
        return cpb.Encoding(
            dtype=cpb.DTYPE_UINT64_LE,
            packing=packing,
            fixed_point=cpb.FixedPointEncoding(
                bound=bound, frac_bits=spec.codec().frac_bits, min_survivors=spec.min_survivors
            ),
        )

    def dp_encodings(self, plan: cpb.ReleasePlan) -> None:
        """DP mode: bounds, f and t_R of the noised statistics (:mod:`afl.server.dp_mask`)."""
        dp_mask_encodings(plan, max_samples=self.settings.max_samples)

    # --- uploads (AggregationStrategy) -------------------------------------------------------

    def check_payload(self, release: PlannedRelease, data: bytes) -> None:
        n = release_length(_as_proto(release))
        if len(data) != 8 * n:
            raise InvalidRequestError(
                f"masked release {release.name!r} must be {n} uint64 ({8 * n} bytes), "
                f"got {len(data)} bytes"
            )

    def release_sum(
        self, release: PlannedRelease, payloads: Mapping[str, bytes]
    ) -> NDArray[np.float64]:
        raise WrongStageError("masked releases are decoded by the Unmask stage, not summed")

    def admit_upload(self, view: Any, site_id: str) -> None:
        """Masked input is accepted only in the UPLOAD stage, from sites of U2."""
        state = self.rounds.get(view.round_id)
        if view.row.stage != pb.ROUND_STAGE_UPLOAD or state is None:
            raise WrongStageError("masked input is accepted only in the UPLOAD stage")
        if site_id not in state.expected:
            raise NotPermittedError(f"site {site_id!r} dropped out before MaskedInput")

    # --- stage driver ------------------------------------------------------------------------

    def drive(self, machine: Any, view: Any) -> bool:
        """Advance the masked exchange of ``view``; False leaves the stage to the round machine."""
        stage = view.row.stage
        if stage == pb.ROUND_STAGE_PLAN_REVIEW:
            decisions = machine.store.decisions(view.round_id)
            participants = view.row.participants
            if any(not ok for ok, _ in decisions.values()) or not set(participants) <= set(
                decisions
            ):
                return False
            self._start(view)
            self._next(machine, view, pb.ROUND_STAGE_ADVERTISE_KEYS)
            return True
        if stage not in MASK_STAGES:
            return False
        state = self.rounds.get(view.round_id)
        if state is None:
            self._abort(machine, view, "the server restarted during the masked exchange")
            return True
        if stage == pb.ROUND_STAGE_UPLOAD:
            self._feed_uploads(machine, view, state)
        if set(state.received) < state.expected and machine.now_ms() < view.row.deadline_ms:
            return True
        try:
            following = self._close(view.row.stage, state)
        except RoundAbortedError as exc:
            self._abort(machine, view, str(exc))
            return True
        if following == pb.ROUND_STAGE_SOLVING:
            result = state.server.result
            assert result is not None
            if result.withheld:
                why = "; ".join(f"{n}: {r}" for n, r in sorted(result.withheld.items()))
                self._abort(machine, view, f"releases withheld, nothing released ({why})")
                return True
            self._sums[view.round_id] = {
                r.name: _shaped(r, result.sums[r.name]) for r in view.releases
            }
            self._contributors[view.round_id] = result.survivors
            del self.rounds[view.round_id]
        self._next(machine, view, following)
        return True

    def _start(self, view: Any) -> None:
        plan = cpb.ReleasePlan.FromString(view.row.plan)
        config = round_config_from_plan(plan)
        server = SecAggServer(config=config, identities=self._identities)
        lengths = {r.name: r.length for r in config.releases}
        self.rounds[view.round_id] = MaskRound(server, lengths, set(config.cohort))

    def _next(self, machine: Any, view: Any, stage: int) -> None:
        timeout_ms = int(machine.config.round.upload_timeout_s * 1000)
        machine._set_stage(view, stage, deadline_ms=machine.now_ms() + timeout_ms)

    def _abort(self, machine: Any, view: Any, reason: str) -> None:
        self.rounds.pop(view.round_id, None)
        log.warning("masked round aborted", extra={"round_id": view.round_id, "reason": reason})
        machine._set_stage(view, pb.ROUND_STAGE_ABORTED, reason=reason)
        machine.metrics.rounds.labels(outcome="aborted").inc()

    def _close(self, stage: int, state: MaskRound) -> int:
        server = state.server
        state.received = {}
        if stage == pb.ROUND_STAGE_ADVERTISE_KEYS:
            state.directory = server.close_advertise()
            state.expected = {a.site_id for a in state.directory.adverts}
            return pb.ROUND_STAGE_SHARE_KEYS
        if stage == pb.ROUND_STAGE_SHARE_KEYS:
            state.routed = server.close_share_keys()
            state.expected = set(state.routed)
            return pb.ROUND_STAGE_UPLOAD
        if stage == pb.ROUND_STAGE_UPLOAD:
            state.survivors = server.close_masked_input().survivors
            state.expected = set(state.survivors)
            return pb.ROUND_STAGE_CONSISTENCY_CHECK
        if stage == pb.ROUND_STAGE_CONSISTENCY_CHECK:
            state.unmask = server.close_consistency()
            state.expected = {s.site_id for s in state.unmask.signatures}
            return pb.ROUND_STAGE_UNMASK
        server.close_unmask()
        return pb.ROUND_STAGE_SOLVING

    def _feed_uploads(self, machine: Any, view: Any, state: MaskRound) -> None:
        uploads = machine.store.uploads(view.round_id)
        for site in sorted(state.expected - set(state.received)):
            names = [n for n in state.lengths if site in state.server.config.release(n).members]
            if not all((site, n) in uploads for n in names):
                continue
            payloads = {n: machine.store.read_payload(uploads[(site, n)]) for n in names}
            message = masked_upload(site, view.round_id, payloads, state.lengths)
            try:
                state.server.receive(message, sender=site)
            except ProtocolError as exc:
                log.warning("masked input refused", extra={"site_id": site, "reason": str(exc)})
                continue
            state.received[site] = b""

    # --- requests (called with the round machine's lock held) --------------------------------

    def state(self, view: Any, stage: int) -> MaskRound:
        """The round's state, if it is (at least) in ``stage``; else :class:`WrongStageError`."""
        state = self.rounds.get(view.round_id)
        if state is None or view.row.stage < stage:
            raise WrongStageError(
                f"round {view.round_id!r} is {pb.RoundStage.Name(view.row.stage)}, "
                f"not {pb.RoundStage.Name(stage)}"  # type: ignore[arg-type]
            )
        return state

    def receive(self, view: Any, site: str, stage: int, message: ClientMessage, raw: bytes) -> bool:
        """Hand one client message of ``stage`` to the protocol; True if it was a retry of the
        same request (idempotent), :class:`ConflictError` if it differs from the first."""
        state = self.state(view, stage)
        if view.row.stage != stage:
            raise WrongStageError(f"round {view.round_id!r} has moved past this stage")
        if site in state.received:
            if state.received[site] == raw:
                return True
            raise ConflictError("a different message of this stage was already received")
        try:
            state.server.receive(message, sender=site)
        except (StageError, UnknownParticipantError) as exc:
            raise WrongStageError(str(exc)) from exc
        except DuplicateMessageError as exc:
            raise ConflictError(str(exc)) from exc
        except ProtocolError as exc:
            raise InvalidRequestError(str(exc)) from exc
        state.received[site] = raw
        return False

    # --- solve hooks -------------------------------------------------------------------------

    def decoded_sums(self, view: Any) -> Mapping[str, NDArray[np.float64]] | None:
        sums = self._sums.get(view.round_id)
        if sums is None:
            raise WrongStageError(f"round {view.round_id!r} has no unmasked sums (restarted?)")
        return sums

    def contributors(self, view: Any) -> tuple[str, ...]:
        return self._contributors.get(view.round_id, tuple(view.row.participants))


def _as_proto(release: PlannedRelease) -> cpb.Release:
    packing = cpb.PACKING_UPPER_TRIANGLE if release.packed else cpb.PACKING_DENSE
    return cpb.Release(shape=list(release.shape), encoding=cpb.Encoding(packing=packing))


def _shaped(release: PlannedRelease, flat: NDArray[np.float64]) -> NDArray[np.float64]:
    if release.packed:
        return unpack_upper(flat)
    return np.asarray(flat, dtype=np.float64).reshape(release.shape)
