"""A masked round's consistency signature carries the site's `opening` statement
(docs/protocol.md M-232): the servicer has the coordinator log it, with RecordOpening's checks,
before the mask mode keeps the signature; a refused opening refuses the signature (the call
ends with the refusal's status, nothing kept), and the signature is kept without the opening's
bytes. The coordinator and the mask mode are stand-ins that record what reaches them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.errors import NotPermittedError
from afl.server.servicer import CoordinatorServicer


class _Aborted(Exception):
    """What ``context.abort`` raises here (gRPC's own raises in its server thread)."""


class _Context:
    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise _Aborted(code, message)

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass


def _servicer(events: list[tuple[str, bytes]], *, refuse: bool = False) -> CoordinatorServicer:
    def log_opening(site: str, request: pb.Opening, *, survivors_of: Any) -> pb.LogProof:
        events.append(("logged", bytes(request.statement)))
        if refuse:
            raise NotPermittedError(f"an opening of {site} misstates the round")
        return pb.LogProof(index=7)

    def consistency_check(site: str, request: pb.ConsistencySignature) -> Any:
        events.append(("kept", request.SerializeToString()))
        return "ack"

    counter = SimpleNamespace(inc=lambda: None)
    servicer = object.__new__(CoordinatorServicer)  # no server: only the call's own logic
    servicer.coordinator = SimpleNamespace(  # type: ignore[assignment]
        log_opening=log_opening,
        metrics=SimpleNamespace(rpc_errors=SimpleNamespace(labels=lambda **kw: counter)),
    )
    servicer._mask = SimpleNamespace(consistency_check=consistency_check)  # type: ignore[assignment]
    servicer._identify = lambda context: "site-1"  # type: ignore[method-assign]
    return servicer


def _signature(opening: bytes) -> pb.ConsistencySignature:
    return pb.ConsistencySignature(
        round_id="r1", survivors=["site-1", "site-2"], signature=b"sig", opening=opening
    )


def test_the_opening_is_logged_before_the_signature_is_kept_without_it() -> None:
    events: list[tuple[str, bytes]] = []
    servicer = _servicer(events)
    context: Any = _Context()
    assert servicer.ConsistencyCheck(_signature(b"the opening"), context) == "ack"
    assert [what for what, _ in events] == ["logged", "kept"]
    assert events[0][1] == b"the opening"
    assert events[1][1] == _signature(b"").SerializeToString()  # the signature alone
    events.clear()
    servicer.ConsistencyCheck(_signature(b""), context)  # none carried: nothing to log
    assert [what for what, _ in events] == ["kept"]


def test_a_refused_opening_refuses_the_signature() -> None:
    events: list[tuple[str, bytes]] = []
    context: Any = _Context()
    with pytest.raises(_Aborted) as refused:
        _servicer(events, refuse=True).ConsistencyCheck(_signature(b"the opening"), context)
    code, message = refused.value.args
    assert code is grpc.StatusCode.PERMISSION_DENIED and "misstates the round" in message
    assert [what for what, _ in events] == ["logged"]  # no signature kept
