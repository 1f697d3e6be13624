"""The daemon's conversation with the coordinator: every RPC with retries and back-off
(:func:`afl.client.daemon.transport.with_retry`), enrolment, chunked uploads and downloads, and
waiting for a round and for a round's stage. Used by the site daemon, its aggregation modes and the
CKKS decryptor alike.

Enrolment (``GetEnrolChallenge`` then ``Enroll``; docs/protocol.md §3, M-74): the identity public
key with a proof of possession over the server's fresh challenge and every declared field
(signature, context "enrol", :func:`afl.proto.wire.enrol_proof_fields`, with the server identity
key of the startup kit): backbone, d, weights digest, random-init stamp and row bounds when the
site's policy allows. The challenge and the reply must name this federation and this site, and
the reply must carry the kit's server identity key; a note in the reply (e.g. classes the
federation does not use) is logged. A retried enrolment asks for a new challenge (a nonce is valid
once).

Round changes reach the site by stream: :class:`RoundWatcher` keeps a ``WatchRounds``
subscription open in a background thread (reconnecting with back-off) and wakes the waiting
daemon on every event. A wait for a round (:meth:`CoordinatorClient.wait_for_round`) then reads
its own status with ``GetStatus``. A wait for a stage (:meth:`CoordinatorClient.await_stage`)
reads it only when it needs to: while the stream's newest event of the round shows an earlier
stage than the one awaited, the stream announces the next one, so K sites waiting at a barrier
do not each read their status on every event. Once the stream shows the stage reached (or the
round aborted), a wait that needs only the stage (``stage_only``: the masked exchange's
barriers, inside a round whose status the site read when the wait began) returns the event's
status without a call: the event carries the round's stage from the same authenticated
coordinator, committed before it was announced, and a re-opened stream starts with no status.
The waits whose answer the restore check needs (M-142: the wait for a round, for the upload
stage, and for the model, whose answer names the latest model) always return a ``GetStatus``
answer, read once the stream shows the stage (or the round) reached. Polling is the fallback:
while the stream is down, shows no event of the round yet (or the server does not offer it)
the wait polls, starting at ``poll_interval_s`` and growing by 1.5x per idle poll up to
``max_poll_interval_s``; while the stream is up a wait still reads ``GetStatus`` at least every
``max_poll_interval_s`` as a safety net. Waits give up after ``max_wait_s`` (DaemonError), or,
when ``lingering``, return None after ``linger_s``
without a new round (a serving daemon waits for ever).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from afl.client.config import TimingConfig
from afl.client.daemon.transport import (
    DaemonError,
    RetryPolicy,
    download_payload,
    status_code,
    upload_payload,
    with_retry,
)
from afl.core.row_bounds import RowBounds
from afl.crypto.identity import signatures, signed_blobs
from afl.proto import wire
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = ["CoordinatorClient", "RoundFailed", "RoundWatcher", "check_enrolment"]

log = logging.getLogger("afl.client")


STAGE_POLL_CAP_S = 0.25


class RoundFailed(DaemonError):
    """A round ended for this site without a model (refused, aborted or failed)."""

    def __init__(self, outcome: int, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome
        self.reason = reason


def check_enrolment(
    response: pb.EnrollResponse, *, site_id: str, federation_id: str, server_public_key: bytes
) -> None:
    """The enrolment reply must carry the kit's server identity key, this federation and this
    site (:class:`DaemonError` otherwise); a note in it is logged."""
    if response.server_identity_public_key != server_public_key:
        raise DaemonError("the server's identity key differs from the one in the startup kit")
    if response.federation_id != federation_id:
        raise DaemonError(f"the server serves federation {response.federation_id!r}")
    if response.site_id and response.site_id != site_id:
        raise DaemonError(f"the server sees this site as {response.site_id!r}")
    if response.message and response.message != "enrolled":
        log.warning("site=%s enrolment: %s", site_id, response.message)


#: How long :meth:`RoundWatcher.stop` waits for its thread (it ends at once once cancelled).
STOP_JOIN_S = 60.0


class RoundWatcher:
    """A ``WatchRounds`` subscription in a background thread (module docstring)."""

    def __init__(self, stub: Any, *, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._stub, self._metadata = stub, metadata
        self._event = threading.Event()
        self._stopped = threading.Event()
        self._call: Any = None
        self.unavailable = False
        self.events_received = 0
        #: round id -> the round's status in the newest event of the open stream; None while no
        #: stream is open (a fresh dict per stream: a restarted coordinator speaks afresh).
        self.latest: dict[str, pb.RoundStatus] | None = None
        self._thread = threading.Thread(target=self._run, name="afl-watch-rounds", daemon=True)

    @property
    def connected(self) -> bool:
        """Whether a stream is open."""
        return self.latest is not None

    def start(self) -> RoundWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the stream and its thread, and let go of the call. A gRPC call's finalizer takes
        the call's lock; run while the interpreter finalizes, it waits forever for a lock that a
        daemon thread (this one, or gRPC's own) held when it was stopped, and the process never
        exits (seen once in a CI run: a site hung after its report). So the thread is joined
        until it ends (a cancelled call ends at once), and the call is dropped here, while
        every thread still runs, not at exit."""
        self._stopped.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=STOP_JOIN_S)
        if self._thread.is_alive():  # pragma: no cover - a gRPC call that ignored its cancel
            log.warning("the WatchRounds stream did not end within %.0f s", STOP_JOIN_S)
            return
        del call
        self._call = None  # its finalizer runs now

    def _run(self) -> None:
        delay = 0.5
        while not self._stopped.is_set():
            try:
                call = self._stub.WatchRounds(pb.WatchRequest(), metadata=self._metadata or None)
                self._call = call
                if self._stopped.is_set():  # stop() ran meanwhile and cancelled the call before
                    call.cancel()
                latest: dict[str, pb.RoundStatus] = {}
                self.latest = latest
                for event in call:
                    latest[event.status.round_id] = event.status
                    self.events_received += 1
                    self._event.set()
                    delay = 0.5
            except grpc.RpcError as exc:
                if status_code(exc) == grpc.StatusCode.UNIMPLEMENTED:
                    self.unavailable = True
                    log.info("the coordinator offers no WatchRounds stream: polling instead")
                    return
            finally:
                self.latest = None
                self._event.set()  # a waiter re-reads its status (and falls back to polling)
            self._stopped.wait(delay)
            delay = min(2 * delay, 10.0)

    def wait(self, timeout: float) -> None:
        """Block until the next round event (or ``timeout``)."""
        self._event.wait(timeout)
        self._event.clear()

    def shows(self, round_id: str) -> bool:
        """Whether the open stream has announced an event of the round (so it announces the
        round's next stage too)."""
        latest = self.latest
        return latest is not None and round_id in latest

    def reached(self, round_id: str, at_least: int) -> pb.RoundStatus | None:
        """The round's status in the open stream's newest event of it, if that shows the round
        at ``at_least`` or later, or aborted; else None (no stream, no event of the round yet,
        or an earlier stage)."""
        latest = self.latest  # one read: the open stream's statuses, or None
        r = latest.get(round_id) if latest is not None else None
        if r is None or not (r.stage >= at_least or r.stage == pb.ROUND_STAGE_ABORTED):
            return None
        return r


#: How often a site waiting for a round logs what it waits for (seconds).
WAIT_LOG_INTERVAL_S = 60.0


def _waiting_for(r: pb.RoundStatus | None, note: str) -> str:
    """What a waiting site waits for, in words."""
    if note:
        return f"left out of the current run ({note})"
    if r is None:
        return "no round is open yet (the coordinator starts one when its run's sites enrol)"
    if r.stage in (pb.ROUND_STAGE_UNSPECIFIED, pb.ROUND_STAGE_WAITING_FOR_PARTICIPANTS):
        return (
            f"round {r.round_id} is waiting for its participants to enrol "
            f"({', '.join(r.participants) or 'none listed yet'})"
        )
    return f"round {r.round_id} is at stage {pb.RoundStage.Name(r.stage)}"


class CoordinatorClient:
    """RPCs of one site with its deadline, retry policy and (insecure mode) metadata."""

    def __init__(
        self,
        stub: Any,
        *,
        site_id: str,
        timing: TimingConfig,
        retry: RetryPolicy,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.stub = stub
        self.site_id = site_id
        self.timing = timing
        self.retry = retry
        self.metadata = metadata
        self.watcher: RoundWatcher | None = None
        #: Rounds that went by without this site: (round id, aborted, why), oldest first.
        self.passed: list[tuple[str, bool, str]] = []
        # Checks every status answer before it is used (the site's Witness: a restored
        # coordinator is refused); None: no check.
        self.observe: Callable[[pb.StatusResponse], None] | None = None

    def watch(self) -> RoundWatcher:
        """Subscribe to round events (call after enrolling); :meth:`close` ends it."""
        if self.watcher is None:
            self.watcher = RoundWatcher(self.stub, metadata=self.metadata).start()
        return self.watcher

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None

    def call(self, what: str, request: Any, **kw: Any) -> Any:
        """``stub.<what>(request)`` with the RPC deadline and retries."""
        method = getattr(self.stub, what)
        timeout = self.timing.rpc_timeout_s
        return with_retry(
            lambda: method(request, timeout=timeout, metadata=self.metadata or None, **kw),
            what=what,
            policy=self.retry,
        )

    def upload(
        self,
        data: bytes,
        *,
        round_id: str,
        release_name: str,
        kind: int = pb.PAYLOAD_KIND_STATISTIC,
    ) -> pb.UploadReceipt:
        """A chunked ``Upload`` whose receipt is checked against what was sent."""
        return upload_payload(
            self.stub,
            data,
            round_id=round_id,
            release_name=release_name,
            kind=kind,
            policy=self.retry,
            timeout_s=self.timing.upload_timeout_s,
            metadata=self.metadata,
        )

    def download(self, request: pb.DownloadRequest, *, max_bytes: int = 1 << 30) -> bytes:
        """A ``Download`` stream, reassembled and digest-checked (at most ``max_bytes``)."""
        return download_payload(
            self.stub,
            request,
            policy=self.retry,
            timeout_s=self.timing.upload_timeout_s,
            metadata=self.metadata,
            max_bytes=max_bytes,
        )

    def enroll(
        self,
        *,
        federation_id: str,
        identity: Ed25519PrivateKey,
        identity_public_key: bytes,
        server_public_key: bytes,
        role: int,
        labelled_classes: Sequence[str] = (),
        backbone: str = "",
        feature_dim: int = 0,
        software_version: str = "",
        row_bounds: RowBounds | None = None,
        weights_sha256: str = "",
        random_init: bool = False,
    ) -> pb.EnrollResponse:
        """Enroll this site (module docstring); :class:`DaemonError` if the reply does not match
        the startup kit."""
        timeout = self.timing.rpc_timeout_s
        metadata = self.metadata or None

        def attempt() -> pb.EnrollResponse:
            challenge: pb.EnrolChallenge = self.stub.GetEnrolChallenge(
                pb.EnrolChallengeRequest(), timeout=timeout, metadata=metadata, wait_for_ready=True
            )
            if challenge.federation_id != federation_id or challenge.site_id != self.site_id:
                raise DaemonError(
                    f"the server's challenge is for {challenge.site_id!r} in "
                    f"{challenge.federation_id!r}, not this site's federation"
                )
            request = pb.EnrollRequest(
                identity_public_key=identity_public_key,
                role=role,  # type: ignore[arg-type]
                labelled_classes=list(labelled_classes),
                backbone=backbone,
                feature_dim=feature_dim,
                software_version=software_version,
                protocol_version=wire.PROTOCOL_VERSION,
                challenge=challenge.nonce,
                declared_rows=row_bounds.rows if row_bounds else 0,
                declared_max_row_norm=row_bounds.max_row_norm if row_bounds else 0.0,
                weights_sha256=weights_sha256,
                random_init=random_init,
            )
            request.proof = signatures.sign_fields(
                identity,
                context=signed_blobs.ENROL_CONTEXT,
                fields=wire.enrol_proof_fields(
                    request,
                    federation_id=federation_id,
                    site_id=self.site_id,
                    server_identity_public_key=server_public_key,
                ),
            )
            reply: pb.EnrollResponse = self.stub.Enroll(
                request, timeout=timeout, metadata=metadata, wait_for_ready=True
            )
            return reply

        # Each retry fetches a new challenge: the server consumes a nonce on its first use.
        response = with_retry(attempt, what="Enroll", policy=self.retry)
        check_enrolment(
            response,
            site_id=self.site_id,
            federation_id=federation_id,
            server_public_key=server_public_key,
        )
        return response

    def status(self, round_id: str = "") -> pb.StatusResponse:
        status: pb.StatusResponse = self.call("GetStatus", pb.StatusRequest(round_id=round_id))
        if self.observe is not None:
            self.observe(status)
        return status

    def _pause(
        self, delay: float, *, cap: float | None = None, until_poll_s: float | None = None
    ) -> float:
        """Wait for the next round event (stream up: at most ``until_poll_s``, by default
        ``max_poll_interval_s``) or ``delay`` (polling); the next delay."""
        if self.watcher is not None and self.watcher.connected:
            wait_s = self.timing.max_poll_interval_s if until_poll_s is None else until_poll_s
            self.watcher.wait(max(wait_s, 0.0))
            return delay
        time.sleep(delay)
        return min(delay * 1.5, self.timing.max_poll_interval_s if cap is None else cap)

    def wait_for_round(
        self, done: set[str], *, lingering: bool, forever: bool = False
    ) -> pb.RoundStatus | None:
        """The next round this site takes part in, or None after ``linger_s`` without one
        (``forever``: no time limit). A round that listed this site and was aborted before it
        took part starts the ``linger_s`` wait for a replacement; :attr:`passed` records why
        each round went by without it. While it waits, the site logs what it waits for when it
        starts and every :data:`WAIT_LOG_INTERVAL_S` seconds."""
        t = self.timing
        start = time.monotonic()
        delay = t.poll_interval_s
        noted = ""
        next_log = start
        while True:
            status = self.status()
            if status.note and status.note != noted:
                log.warning(
                    "site=%s takes no part in the current run: %s", self.site_id, status.note
                )
                noted = status.note
            r = status.round if status.HasField("round") else None
            if r is not None and r.round_id not in done:
                waiting = r.stage in (
                    pb.ROUND_STAGE_UNSPECIFIED,
                    pb.ROUND_STAGE_WAITING_FOR_PARTICIPANTS,
                )
                missed = r.stage >= pb.ROUND_STAGE_SOLVING and not r.caller_accepted_plan
                if not waiting and (self.site_id not in r.participants or missed):
                    log.info("site=%s takes no part in round %s", self.site_id, r.round_id)
                    done.add(r.round_id)
                    if r.stage == pb.ROUND_STAGE_ABORTED and self.site_id in r.participants:
                        why = f"round {r.round_id} was aborted before this site took part: {r.abort_reason}"
                        self.passed.append((r.round_id, True, why))
                        lingering, start = True, time.monotonic()  # wait for a replacement
                    else:
                        self.passed.append(
                            (
                                r.round_id,
                                False,
                                status.note or f"not a participant of round {r.round_id}",
                            )
                        )
                elif not waiting and r.stage != pb.ROUND_STAGE_ABORTED:
                    return r
            now = time.monotonic()
            if now >= next_log:
                log.info(
                    "site=%s waiting for a round it takes part in: %s (%.0f s so far)",
                    self.site_id, _waiting_for(r, status.note), now - start,
                )  # fmt: skip
                next_log = now + WAIT_LOG_INTERVAL_S
            elapsed = now - start
            if not forever and lingering and elapsed > t.linger_s:
                return None
            if not forever and elapsed > t.max_wait_s:
                raise DaemonError(f"no round opened within max_wait_s = {t.max_wait_s:g} s")
            delay = self._pause(delay)

    def await_stage(
        self, round_id: str, *, at_least: int, stage_only: bool = False
    ) -> pb.RoundStatus:
        """Poll until the round reaches ``at_least``; :class:`RoundFailed` if it aborts. The
        answer is the round's status as this site's ``GetStatus`` gave it, or, with
        ``stage_only`` (the caller reads only the stage), as the stream's event of the stage gave
        it (module docstring), without the caller's own fields (its uploads, its decision)."""
        t = self.timing
        start = read = time.monotonic()
        delay = t.poll_interval_s
        while True:
            watcher = self.watcher
            seen = watcher.reached(round_id, at_least) if watcher is not None else None
            r: pb.RoundStatus | None = None
            waiting_on_stream = (
                seen is None
                and watcher is not None
                and watcher.shows(round_id)  # at an earlier stage: the next one comes on it
                and time.monotonic() - read < t.max_poll_interval_s  # else the safety net
            )
            if seen is not None and stage_only:
                r = seen
            elif not waiting_on_stream:  # no stream or event of the round yet, the stage
                r = self.status(round_id).round  # reached (its fields), or the safety net
                read = time.monotonic()
            if r is not None:
                if r.stage == pb.ROUND_STAGE_ABORTED:
                    raise RoundFailed(pb.CLIENT_OUTCOME_ABORTED, f"round aborted: {r.abort_reason}")
                if r.stage >= at_least:
                    return r
            if time.monotonic() - start > t.max_wait_s:
                raise DaemonError(f"round {round_id} did not reach stage {at_least} in time")
            # Within a round the next stage is usually seconds away (the peers' work), so the
            # poll interval stays short instead of backing off to max_poll_interval_s; on the
            # stream, the wait ends at the next event or when the safety net's read is due.
            delay = self._pause(
                delay,
                cap=min(STAGE_POLL_CAP_S, t.max_poll_interval_s),
                until_poll_s=t.max_poll_interval_s - (time.monotonic() - read),
            )
