"""The decryptor's public CKKS context, one per federation (docs/protocol.md §4.3).

The decryptor uploads its PUBLIC context and signs an announcement; the coordinator checks it
(:func:`afl.crypto.ckks.scheme.load_public_context` refuses a context holding a secret key or other
parameters than the vetted ones) and keeps it under ``<state_dir>/ckks/`` (mode 0600), re-loading
and re-checking it when it restarts; every CKKS run of the federation uses it. A server configured
with a context holding a secret key refuses to start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afl.crypto.ckks import scheme as ckks
from afl.crypto.errors import CryptoError
from afl.crypto.identity import pki
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import ServerConfig
from afl.server.errors import ConfigError, ConflictError, InvalidRequestError, WrongStageError

__all__ = ["CkksContexts", "PublishedContext", "load_public_context_file"]


def load_public_context_file(path: Path) -> tuple[bytes, Any]:
    """Read a serialized CKKS context; :class:`ConfigError` (refuse to start) if it holds a
    secret key or does not have the vetted parameters."""
    data = path.read_bytes()
    try:
        ctx = ckks.load_public_context(data)
    except CryptoError as exc:
        raise ConfigError(
            f"{path}: refusing to start: the CKKS context is not an acceptable PUBLIC context "
            f"({exc}); the server must never hold the decryptor's secret key"
        ) from exc
    return data, ctx


@dataclass
class PublishedContext:
    """The decryptor's public context as published (bytes, parsed context, announcement)."""

    data: bytes
    ctx: Any
    announcement: pb.CkksContextAnnouncement


class CkksContexts:
    """The decryptor's public context, one per federation (module docstring): staged uploads,
    the published context (persisted under ``<state_dir>/ckks``) and the configured one."""

    def __init__(
        self, *, state_dir: Path | None = None, configured_context: Path | None = None
    ) -> None:
        self._dir = None if state_dir is None else Path(state_dir) / "ckks"
        self.staged: dict[str, bytes] = {}
        self.published: PublishedContext | None = None
        self.configured: tuple[bytes, Any] | None = None
        if configured_context is not None:
            self.configured = load_public_context_file(configured_context)
        if self._dir is not None and (self._dir / "context.bin").is_file():
            data, ctx = load_public_context_file(self._dir / "context.bin")
            announcement = pb.CkksContextAnnouncement.FromString(
                (self._dir / "announcement.bin").read_bytes()
            )
            self.published = PublishedContext(data, ctx, announcement)

    @classmethod
    def from_config(cls, config: ServerConfig) -> CkksContexts:
        return cls(state_dir=config.state_dir, configured_context=config.ckks_public_context)

    def publish(self, published: PublishedContext) -> None:
        """Record the decryptor's checked public context (persisted when a state dir is set).
        Set once and never replaced: readers may take :attr:`published` without a lock."""
        ckks.ensure_public(published.ctx)
        if self.configured is not None and self.configured[0] != published.data:
            raise InvalidRequestError("the published context differs from the configured one")
        if self.published is not None:
            if self.published.data != published.data:
                raise ConflictError("a different CKKS context is already published")
            return
        if self._dir is not None:
            folder = pki.make_private_dir(self._dir)
            pki.write_private_file(folder / "context.bin", published.data)
            pki.write_private_file(
                folder / "announcement.bin", published.announcement.SerializeToString()
            )
        self.published = published

    def context(self) -> PublishedContext:
        if self.published is None:
            raise WrongStageError("the decryptor has not published its CKKS context yet")
        return self.published
