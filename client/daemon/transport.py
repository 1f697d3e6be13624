"""The afl-client's side of the wire: mTLS channel, retries with back-off, chunked uploads and
downloads (docs/protocol.md §3; proto/afl/proto/v1/coordinator.proto).

Retries: a call failing with UNAVAILABLE or DEADLINE_EXCEEDED, or with a status the coordinator
marks "try later" (RESOURCE_EXHAUSTED with the trailing metadata
:data:`afl.proto.wire.TRY_LATER_TRAILER`: its disk is full, a per-site stream limit is reached),
is retried after ``min(max_s, initial_s · multiplier^i) · U(0.5, 1)`` seconds (exponential
back-off with jitter), at least ``attempts`` times in all and for at least ``window_s`` seconds
(default 180 s, longer than a coordinator restart takes); each retry is logged with its cause.
Every other status is final, and so is any answer carrying
:data:`afl.proto.wire.REFUSAL_TRAILER` (a coordinator that refuses its state,
:mod:`afl.server.daemon.refusal`): :class:`CoordinatorRefused` names the coordinator's reason at
once instead of retrying for the whole window. Uploads are idempotent on the
server by (round, site, release, SHA-256), so a retried upload never counts twice.

Framing of uploads and downloads: :mod:`afl.proto.wire` (chunks of at most 1 MiB, the header on
every chunk, the SHA-256 of the whole payload on the last one).
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from afl.client.config import ClientConfig, TimingConfig
from afl.proto import wire
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = [
    "RETRYABLE_CODES",
    "CoordinatorRefused",
    "DaemonError",
    "RemoteCallError",
    "RetryPolicy",
    "UploadError",
    "check_receipt",
    "check_round_id",
    "download_payload",
    "open_channel",
    "retry_policy",
    "status_code",
    "upload_payload",
    "with_retry",
]

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# Metadata naming the site on an --insecure (development) channel, where no certificate exists.
INSECURE_SITE_HEADER = "x-afl-site-id"

T = TypeVar("T")
log = logging.getLogger("afl.client")


class DaemonError(Exception):
    """The client daemon cannot go on (the message says why; never statistics or keys)."""


_ROUND_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_round_id(round_id: str) -> str:
    """``round_id`` if it can name a file in the site's state (the coordinator chooses round ids
    and the site names its reports, models and ledger entries by them); :class:`DaemonError`
    for anything else, e.g. a path such as ``../../x``."""
    if not _ROUND_ID.fullmatch(round_id):
        raise DaemonError(
            f"the coordinator names round {round_id[:80]!r}: not a valid round id (1-128 "
            "letters, digits, '.', '_' or '-', starting with a letter or digit)"
        )
    return round_id


class RemoteCallError(DaemonError):
    """An RPC failed with a final status (or ran out of retries)."""

    def __init__(self, what: str, code: grpc.StatusCode | None, details: str) -> None:
        name = code.name if code is not None else "UNKNOWN"
        super().__init__(f"{what}: {name}: {details}")
        self.code = code
        self.details = details


class CoordinatorRefused(RemoteCallError):
    """The coordinator answers that it refuses its state (module docstring): final."""

    def __init__(self, what: str, details: str) -> None:
        super().__init__(what, grpc.StatusCode.UNAVAILABLE, details)


class UploadError(DaemonError):
    """An upload was rejected, or its receipt does not match what was sent."""


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential back-off parameters (see the module docstring)."""

    attempts: int = 8
    initial_s: float = 0.2
    max_s: float = 10.0
    multiplier: float = 2.0
    window_s: float = 0.0

    def delay(self, attempt: int) -> float:
        """Back-off before retry number ``attempt`` (0-based), jittered into [d/2, d]."""
        base = min(self.max_s, self.initial_s * self.multiplier**attempt)
        return base * (0.5 + 0.5 * secrets.SystemRandom().random())


def retry_policy(timing: TimingConfig) -> RetryPolicy:
    """The retry policy of a daemon's [client] timing (module docstring)."""
    return RetryPolicy(
        attempts=timing.retry_attempts,
        initial_s=timing.poll_interval_s,
        window_s=timing.retry_window_s,
    )


def status_code(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC status code of a failed call (None if ``exc`` is not an RPC error)."""
    code = getattr(exc, "code", None)
    if isinstance(exc, grpc.RpcError) and callable(code):
        value = code()
        return value if isinstance(value, grpc.StatusCode) else None
    return None


def _details(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    return str(details()) if callable(details) else str(exc)


def _trailers(exc: BaseException) -> dict[str, str]:
    """The trailing metadata of a failed call ({} when it has none)."""
    trailing = getattr(exc, "trailing_metadata", None)
    try:
        items = trailing() if callable(trailing) else None
    except Exception:  # a call object that cannot give them
        items = None
    return {str(k): str(v) for k, v in items or ()}


def with_retry(
    call: Callable[[], T],
    *,
    what: str,
    policy: RetryPolicy,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run ``call``; retry on UNAVAILABLE/DEADLINE_EXCEEDED and "try later" (module docstring);
    :class:`CoordinatorRefused` at once when the coordinator refuses its state;
    :class:`RemoteCallError` otherwise or when the retry budget is spent."""
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            code = status_code(exc)
            trailers = _trailers(exc)
            if wire.REFUSAL_TRAILER in trailers:
                raise CoordinatorRefused(what, _details(exc)) from exc
            later = (
                code == grpc.StatusCode.RESOURCE_EXHAUSTED and wire.TRY_LATER_TRAILER in trailers
            )
            attempt += 1
            spent = attempt >= policy.attempts and time.monotonic() - start >= policy.window_s
            if not (code in RETRYABLE_CODES or later) or spent:
                raise RemoteCallError(what, code, _details(exc)) from exc
            pause = policy.delay(min(attempt - 1, 30))
            name = code.name if code else "?"
            if later:
                log.warning("%s: %s: %s; retrying in %.2f s", what, name, _details(exc), pause)
            else:
                log.info("%s: %s, retrying in %.2f s", what, name, pause)
            sleep(pause)


def upload_payload(
    stub: Any,
    payload: bytes,
    *,
    round_id: str,
    release_name: str,
    policy: RetryPolicy,
    timeout_s: float,
    metadata: Sequence[tuple[str, str]] = (),
    chunk_bytes: int = wire.MAX_CHUNK_BYTES,
    kind: int = pb.PAYLOAD_KIND_STATISTIC,
) -> pb.UploadReceipt:
    """Stream ``payload`` through ``Coordinator.Upload`` and check the receipt's digest.

    Raises :class:`UploadError` on ALREADY_EXISTS (a different payload was stored for this
    release) or a receipt that does not match; :class:`RemoteCallError` on other failures.
    """
    digest = hashlib.sha256(payload).digest()

    def send() -> pb.UploadReceipt:
        chunks = wire.iter_chunks(
            payload,
            round_id=round_id,
            release_name=release_name,
            kind=kind,
            chunk_bytes=chunk_bytes,
        )
        receipt: pb.UploadReceipt = stub.Upload(
            chunks, timeout=timeout_s, metadata=tuple(metadata) or None
        )
        return receipt

    try:
        receipt = with_retry(send, what=f"upload {release_name}", policy=policy)
    except RemoteCallError as exc:
        if exc.code == grpc.StatusCode.ALREADY_EXISTS:
            raise UploadError(
                f"upload {release_name}: the server already holds a different payload for this "
                f"release of round {round_id} ({exc.details})"
            ) from exc
        raise
    check_receipt(receipt, release_name=release_name, sha256=digest, size=len(payload))
    return receipt


def check_receipt(
    receipt: pb.UploadReceipt, *, release_name: str, sha256: bytes, size: int
) -> None:
    """:class:`UploadError` unless the coordinator's receipt is for what was sent: ``size`` bytes
    with SHA-256 ``sha256``."""
    if receipt.sha256 != sha256 or receipt.bytes_received != size:
        raise UploadError(
            f"upload {release_name}: receipt does not match the payload sent "
            f"({receipt.bytes_received} bytes received of {size}, digest "
            f"{'ok' if receipt.sha256 == sha256 else 'differs'})"
        )


def download_payload(
    stub: Any,
    request: pb.DownloadRequest,
    *,
    policy: RetryPolicy,
    timeout_s: float,
    metadata: Sequence[tuple[str, str]] = (),
    max_bytes: int = 1 << 30,
) -> bytes:
    """A ``Download`` stream, reassembled and checked like an upload (:mod:`afl.proto.wire`:
    chunk order, sizes, the final SHA-256); retried on UNAVAILABLE/DEADLINE_EXCEEDED."""

    def fetch() -> bytes:
        chunks: Iterable[pb.UploadChunk] = stub.Download(
            request, timeout=timeout_s, metadata=tuple(metadata) or None
        )
        try:
            payload = wire.assemble(chunks, max_bytes=max_bytes, require_names=False)
            return payload.data
        except wire.WireError as exc:
            raise DaemonError(
                f"download of {request.release_name or 'the context'}: {exc}"
            ) from exc

    return with_retry(fetch, what="Download", policy=policy)


def open_channel(config: ClientConfig, *, insecure: bool = False) -> grpc.Channel:
    """A channel to the coordinator: mTLS with the kit's CA, certificate and key (docs/protocol.md §3).

    ``insecure`` (development only) opens a plaintext channel and logs a loud warning.
    """
    options = [
        ("grpc.max_send_message_length", 8 * wire.MAX_CHUNK_BYTES),
        ("grpc.max_receive_message_length", 64 * wire.MAX_CHUNK_BYTES),
        # A channel of its own: sites hosted in one process (afl-client run-many) never share a
        # connection, so every call travels under its own site's certificate.
        ("grpc.use_local_subchannel_pool", 1),
        # Reconnect to a restarted coordinator within seconds (gRPC's default backs off up to
        # 120 s, so a site would keep failing fast long after the coordinator is back, or
        # learn late that it refuses its state).
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.min_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 3000),
    ]
    if insecure:
        log.warning(
            "INSECURE: connecting to %s WITHOUT TLS; statistics and identities travel in the "
            "clear. Development only.",
            config.server_address,
        )
        return grpc.insecure_channel(config.server_address, options=options)
    try:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=config.tls.ca_cert.read_bytes(),
            private_key=config.tls.key.read_bytes(),
            certificate_chain=config.tls.cert.read_bytes(),
        )
    except OSError as exc:
        raise DaemonError(f"cannot read the TLS files of the startup kit: {exc}") from exc
    return grpc.secure_channel(config.server_address, credentials, options=options)
