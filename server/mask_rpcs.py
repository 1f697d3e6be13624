"""The MASK-mode RPCs of the Coordinator service (coordinator.proto "MASK mode"; design §6, §9).

:class:`MaskRequests` is transport-free (caller = the site id from its certificate; errors are
:mod:`afl.server.errors` classes); :class:`MaskRpcs` is the gRPC mixin that
:class:`afl.server.servicer.CoordinatorServicer` inherits, routing through its one error mapper.
Every request is checked: the caller is enrolled and a participant of the round, the round runs
MASK mode and is in the request's stage, and the message passes the protocol state machine
(:class:`afl.crypto.secagg_server.SecAggServer`: signatures, senders, shapes, duplicates).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.coordinator import Coordinator
from afl.server.errors import NotPermittedError, WrongStageError
from afl.server.mask_wire import (
    advert_from_proto,
    consistency_from_proto,
    directory_to_proto,
    routed_to_proto,
    share_keys_from_proto,
    unmask_request_to_proto,
    unmask_response_from_proto,
)
from afl.server.mode_mask import MaskStrategy
from afl.server.rounds import RoundView

__all__ = ["MaskRequests", "MaskRpcs"]

T = TypeVar("T")


class MaskRequests:
    """Domain side of the MASK RPCs over one :class:`Coordinator`."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.machine = coordinator.machine

    def _round(self, site: str, round_id: str) -> tuple[RoundView, MaskStrategy]:
        """(call with the lock held) the round, checked for the caller and the mode."""
        strategy = self.machine.strategy
        if not isinstance(strategy, MaskStrategy):
            raise WrongStageError("this server does not run aggregation = 'mask'")
        view = self.machine.find(round_id or "-")
        self.machine.require_participant(view, site)
        return view, strategy

    def _send(self, site: str, round_id: str, stage: int, build: Callable[..., Any]) -> cpb.Ack:
        self.coordinator._enrolled(site)
        with self.machine.lock:
            view, strategy = self._round(site, round_id)
            message, raw = build(view, strategy)
            retry = strategy.receive(view, site, stage, message, raw)
            self.machine.advance()
        return cpb.Ack(message="duplicate ignored" if retry else "received")

    def _get(self, site: str, round_id: str, body: Callable[[RoundView, MaskStrategy], T]) -> T:
        self.coordinator._enrolled(site)
        with self.machine.lock:
            self.machine.advance()  # apply a due deadline before answering
            view, strategy = self._round(site, round_id)
            return body(view, strategy)

    def advertise_keys(self, site: str, request: pb.AdvertiseKeysRequest) -> cpb.Ack:
        return self._send(
            site,
            request.round_id,
            pb.ROUND_STAGE_ADVERTISE_KEYS,
            lambda v, s: (advert_from_proto(site, request), request.SerializeToString()),
        )

    def advertised_keys(self, site: str, round_id: str) -> pb.AdvertisedKeys:
        def body(view: RoundView, strategy: MaskStrategy) -> pb.AdvertisedKeys:
            state = strategy.state(view, pb.ROUND_STAGE_SHARE_KEYS)
            assert state.directory is not None
            return directory_to_proto(state.directory)

        return self._get(site, round_id, body)

    def share_keys(self, site: str, request: pb.ShareKeysRequest) -> cpb.Ack:
        return self._send(
            site,
            request.round_id,
            pb.ROUND_STAGE_SHARE_KEYS,
            lambda v, s: (share_keys_from_proto(site, request), request.SerializeToString()),
        )

    def shared_keys(self, site: str, round_id: str) -> pb.SharedKeys:
        def body(view: RoundView, strategy: MaskStrategy) -> pb.SharedKeys:
            state = strategy.state(view, pb.ROUND_STAGE_UPLOAD)
            if site not in state.routed:
                raise NotPermittedError(f"site {site!r} dropped out before ShareKeys closed")
            return routed_to_proto(state.routed[site])

        return self._get(site, round_id, body)

    def survivors(self, site: str, round_id: str) -> pb.SurvivorList:
        def body(view: RoundView, strategy: MaskStrategy) -> pb.SurvivorList:
            state = strategy.state(view, pb.ROUND_STAGE_CONSISTENCY_CHECK)
            assert state.survivors is not None
            return pb.SurvivorList(round_id=view.round_id, survivors=list(state.survivors))

        return self._get(site, round_id, body)

    def consistency_check(self, site: str, request: pb.ConsistencySignature) -> cpb.Ack:
        def build(view: RoundView, strategy: MaskStrategy) -> tuple[Any, bytes]:
            state = strategy.state(view, pb.ROUND_STAGE_CONSISTENCY_CHECK)
            assert state.survivors is not None
            message = consistency_from_proto(site, request, survivors=state.survivors)
            return message, request.SerializeToString()

        return self._send(site, request.round_id, pb.ROUND_STAGE_CONSISTENCY_CHECK, build)

    def consistency_signatures(self, site: str, round_id: str) -> pb.ConsistencySignatures:
        def body(view: RoundView, strategy: MaskStrategy) -> pb.ConsistencySignatures:
            request = strategy.state(view, pb.ROUND_STAGE_UNMASK).unmask
            assert request is not None
            wire = unmask_request_to_proto(request)
            return pb.ConsistencySignatures(
                round_id=view.round_id, survivors=wire.survivors, signatures=wire.signatures
            )

        return self._get(site, round_id, body)

    def unmask_request(self, site: str, round_id: str) -> pb.UnmaskRequest:
        def body(view: RoundView, strategy: MaskStrategy) -> pb.UnmaskRequest:
            request = strategy.state(view, pb.ROUND_STAGE_UNMASK).unmask
            assert request is not None
            return unmask_request_to_proto(request)

        return self._get(site, round_id, body)

    def unmask(self, site: str, request: pb.UnmaskResponse) -> cpb.Ack:
        return self._send(
            site,
            request.round_id,
            pb.ROUND_STAGE_UNMASK,
            lambda v, s: (unmask_response_from_proto(site, request), request.SerializeToString()),
        )


class MaskRpcs:
    """gRPC methods of the MASK mode; mixed into :class:`afl.server.servicer.CoordinatorServicer`
    (which provides ``coordinator`` and ``_call``, the one error mapper)."""

    coordinator: Coordinator
    _call: Callable[..., Any]
    _mask: MaskRequests | None = None

    def _requests(self) -> MaskRequests:
        if self._mask is None:
            self._mask = MaskRequests(self.coordinator)
        return self._mask

    def AdvertiseKeys(self, request: pb.AdvertiseKeysRequest, context: Any) -> Any:
        return self._call(
            "AdvertiseKeys", context, lambda s: self._requests().advertise_keys(s, request)
        )

    def GetAdvertisedKeys(self, request: cpb.RoundRef, context: Any) -> Any:
        return self._call(
            "GetAdvertisedKeys",
            context,
            lambda s: self._requests().advertised_keys(s, request.round_id),
        )

    def ShareKeys(self, request: pb.ShareKeysRequest, context: Any) -> Any:
        return self._call("ShareKeys", context, lambda s: self._requests().share_keys(s, request))

    def GetSharedKeys(self, request: cpb.RoundRef, context: Any) -> Any:
        return self._call(
            "GetSharedKeys", context, lambda s: self._requests().shared_keys(s, request.round_id)
        )

    def GetSurvivors(self, request: cpb.RoundRef, context: Any) -> Any:
        return self._call(
            "GetSurvivors", context, lambda s: self._requests().survivors(s, request.round_id)
        )

    def ConsistencyCheck(self, request: pb.ConsistencySignature, context: Any) -> Any:
        return self._call(
            "ConsistencyCheck", context, lambda s: self._requests().consistency_check(s, request)
        )

    def GetConsistencySignatures(self, request: cpb.RoundRef, context: Any) -> Any:
        return self._call(
            "GetConsistencySignatures",
            context,
            lambda s: self._requests().consistency_signatures(s, request.round_id),
        )

    def GetUnmaskRequest(self, request: cpb.RoundRef, context: Any) -> Any:
        return self._call(
            "GetUnmaskRequest",
            context,
            lambda s: self._requests().unmask_request(s, request.round_id),
        )

    def Unmask(self, request: pb.UnmaskResponse, context: Any) -> Any:
        return self._call("Unmask", context, lambda s: self._requests().unmask(s, request))
