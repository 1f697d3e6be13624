"""RPCs of the masking and CKKS modes, answered UNIMPLEMENTED until those modes land.

:class:`afl.server.servicer.CoordinatorServicer` derives from :class:`OtherModesServicer`, so the
plaintext servicer is a complete implementation of the generated (abstract) base class.
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from afl.proto.v1 import coordinator_pb2_grpc

__all__ = ["OtherModesServicer"]


def _unimplemented(method: str, context: grpc.ServicerContext) -> NoReturn:
    context.abort(
        grpc.StatusCode.UNIMPLEMENTED,
        f"{method} belongs to the masking/CKKS modes, which this server does not run yet",
    )
    raise AssertionError("unreachable")  # context.abort raises


class OtherModesServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """UNIMPLEMENTED answers for every RPC outside the plaintext flow."""

    def Download(self, request: Any, context: grpc.ServicerContext) -> Any:
        _unimplemented("Download", context)

    def PublishCkksContext(self, request: Any, context: grpc.ServicerContext) -> Any:
        _unimplemented("PublishCkksContext", context)

    def GetCkksContext(self, request: Any, context: grpc.ServicerContext) -> Any:
        _unimplemented("GetCkksContext", context)

    def SendAggregateTags(self, request: Any, context: grpc.ServicerContext) -> Any:
        _unimplemented("SendAggregateTags", context)

    def GetAggregateTags(self, request: Any, context: grpc.ServicerContext) -> Any:
        _unimplemented("GetAggregateTags", context)

    def GetDecryptionJobs(self, request: Any, context: grpc.ServicerContext) -> Any:
        _unimplemented("GetDecryptionJobs", context)

    def ReportDecryption(self, request: Any, context: grpc.ServicerContext) -> Any:
        _unimplemented("ReportDecryption", context)
