"""Error classes of afl.server, one per gRPC status the coordinator returns.

Domain code raises these; :func:`afl.server.servicer.status_for` maps them to status codes in
one place (chunk framing errors are :class:`afl.proto.wire.WireError`). Messages never contain statistics or key material.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ConflictError",
    "DiskFullError",
    "InvalidRequestError",
    "NotPermittedError",
    "RefusedError",
    "ServerError",
    "StateError",
    "StoppingError",
    "WrongStageError",
]


class ServerError(Exception):
    """Base class of every error afl.server raises on behalf of a request."""


class InvalidRequestError(ServerError, ValueError):
    """Malformed request: wrong shape, NaN/inf, bad chunk sequence, digest mismatch."""


class NotPermittedError(ServerError):
    """Unknown or unenrolled site, wrong identity key, not a participant or member."""


class WrongStageError(ServerError):
    """The request does not fit the round's stage, or names another (or no) round."""


class RefusedError(ServerError):
    """The privacy rules refuse the request: a submitted run whose first plan would expose a
    site's statistics with the federation's history (docs/protocol.md M-124)."""


class ConflictError(ServerError):
    """A different payload for a release the site already uploaded."""


class DiskFullError(ServerError):
    """The coordinator's disk is full: a payload could not be stored (RESOURCE_EXHAUSTED)."""


class StoppingError(ServerError):
    """The coordinator is stopping: a call still in flight when the state store closed
    (UNAVAILABLE, which sites retry against the restarted coordinator)."""


class ConfigError(ValueError):
    """server.toml is missing, unreadable or invalid (raised at start-up, not per request)."""


class StateError(RuntimeError):
    """The state directory is unusable (wrong schema version, another federation)."""
