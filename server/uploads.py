"""Reassembly of a chunked client-streaming upload (coordinator.proto ``UploadChunk``, design §9).

A transfer is accepted only if every chunk repeats the same header (round, release, kind, total
chunks, total bytes), indices run 0..total_chunks-1 in order (a duplicated, skipped or reordered
chunk is rejected), no chunk exceeds ``max_chunk_bytes``, the declared total is at most
``max_upload_bytes`` (checked on the FIRST chunk, before buffering), the bytes received equal the
declared total, and SHA-256 of the concatenation equals the digest on the last chunk.

Decoding (plaintext float64): :func:`decode_float64` checks the exact length for the release's
shape and rejects NaN/inf.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from afl.proto.v1 import coordinator_pb2
from afl.server.errors import InvalidRequestError, TooLargeError

__all__ = ["AssembledUpload", "ChunkAssembler", "assemble", "decode_float64"]


@dataclass(frozen=True)
class AssembledUpload:
    """A complete, digest-checked payload."""

    round_id: str
    release_name: str
    kind: int
    data: bytes
    sha256: bytes


class ChunkAssembler:
    """Feed chunks with :meth:`add`, then :meth:`finish`; errors as in the module docstring."""

    def __init__(self, *, max_chunk_bytes: int, max_upload_bytes: int) -> None:
        self._max_chunk = max_chunk_bytes
        self._max_upload = max_upload_bytes
        self._header: tuple[str, str, int, int, int] | None = None
        self._parts: list[bytes] = []
        self._received = 0
        self._digest = b""

    def add(self, chunk: coordinator_pb2.UploadChunk) -> None:
        header = (
            chunk.round_id,
            chunk.release_name,
            int(chunk.kind),
            chunk.total_chunks,
            chunk.total_bytes,
        )
        if self._header is None:
            if not chunk.round_id or not chunk.release_name:
                raise InvalidRequestError("upload chunks must name the round and the release")
            if chunk.total_chunks < 1:
                raise InvalidRequestError("total_chunks must be at least 1")
            if chunk.total_bytes > self._max_upload:
                raise TooLargeError(
                    f"declared upload of {chunk.total_bytes} bytes exceeds the limit of "
                    f"{self._max_upload} bytes"
                )
            self._header = header
        elif header != self._header:
            raise InvalidRequestError("chunk header fields changed within one transfer")
        if len(chunk.data) > self._max_chunk:
            raise TooLargeError(
                f"chunk of {len(chunk.data)} bytes exceeds the limit of {self._max_chunk} bytes"
            )
        expected = len(self._parts)
        if chunk.chunk_index != expected:
            raise InvalidRequestError(
                f"chunk index {chunk.chunk_index} where {expected} was expected (chunks must "
                "arrive once each, in order)"
            )
        if expected >= chunk.total_chunks:
            raise InvalidRequestError("more chunks than total_chunks")
        self._received += len(chunk.data)
        if self._received > chunk.total_bytes:
            raise InvalidRequestError("chunks carry more bytes than total_bytes declares")
        self._parts.append(chunk.data)
        if expected == chunk.total_chunks - 1:
            self._digest = chunk.sha256

    def finish(self) -> AssembledUpload:
        if self._header is None:
            raise InvalidRequestError("empty upload: no chunks received")
        round_id, release_name, kind, total_chunks, total_bytes = self._header
        if len(self._parts) != total_chunks:
            raise InvalidRequestError(
                f"truncated upload: {len(self._parts)} of {total_chunks} chunks received"
            )
        if self._received != total_bytes:
            raise InvalidRequestError(
                f"upload has {self._received} bytes, total_bytes declares {total_bytes}"
            )
        if len(self._digest) != 32:
            raise InvalidRequestError("the last chunk must carry the 32-byte SHA-256 digest")
        data = b"".join(self._parts)
        digest = hashlib.sha256(data).digest()
        if not hmac.compare_digest(digest, self._digest):
            raise InvalidRequestError("SHA-256 of the received payload does not match its digest")
        return AssembledUpload(round_id, release_name, kind, data, digest)


def assemble(
    chunks: Iterable[coordinator_pb2.UploadChunk], *, max_chunk_bytes: int, max_upload_bytes: int
) -> AssembledUpload:
    """Consume a chunk stream into one checked payload."""
    assembler = ChunkAssembler(max_chunk_bytes=max_chunk_bytes, max_upload_bytes=max_upload_bytes)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


def decode_float64(data: bytes, *, length: int, what: str) -> NDArray[np.float64]:
    """``length`` little-endian float64 values; :class:`InvalidRequestError` on a wrong size or
    any NaN/inf (the message names ``what``, never a value)."""
    if len(data) != 8 * length:
        raise InvalidRequestError(
            f"{what}: payload has {len(data)} bytes, the release's shape needs {8 * length}"
        )
    values = np.frombuffer(data, dtype="<f8").astype(np.float64)
    if not np.isfinite(values).all():
        raise InvalidRequestError(f"{what}: payload contains NaN or infinite values")
    return values
