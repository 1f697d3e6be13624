"""The site's ``ckks`` mode: public context, sealed aggregate tags, encrypted uploads
(docs/protocol.md §4.3, docs/architecture.md §4).

Between the accepted plan and the model, a site

1. fetches the decryptor's announcement (``GetCkksContext``; the daemon starts steps 1-2 once
   the site accepted the plan, :class:`ContextPrefetch`): it must name the decryptor pinned
   in the site's policy (``[policy] ckks_decryptor``, never this site) and carry that site's
   signature (context "ckks-context", :mod:`afl.crypto.ckks.wire`), checked with its identity
   key from the startup kit's [peers];
2. downloads the public context (``Download``), checks its SHA-256 against the signed
   announcement and loads it with :func:`afl.crypto.ckks.scheme.load_public_context` (which refuses a
   context holding a secret key, or parameters other than the vetted ones);
3. draws one secret tag r per upload slot (:func:`afl.crypto.ckks.scheme.new_tag`) and sends them sealed
   to the decryptor's X25519 key and signed with the site's identity key over (federation,
   round, plan digest, sender, decryptor, its key) (``SendAggregateTags``,
   :func:`afl.crypto.ckks.wire.seal_tags`; the server can neither read nor forge them);
4. encrypts each slot's float64 values x as x·s (s = the plan's ``CkksEncoding.prescale``) with
   the tags in slot 0 of every ciphertext (:func:`afl.crypto.ckks.scheme.encrypt_block_bytes`) and streams the
   packed ciphertexts (``Upload``, ``DTYPE_CKKS_VECTORS``): the smallest slots first, each
   uploaded on a worker thread while the next is encrypted, so the class vectors' round trips
   overlap the Gram's encryption (the first failed upload stops the rest and is raised).
   Each ciphertext starts from an encryption of zero the daemon drew while it waited, under
   the same verified context (:class:`ZeroFiller`), or is encrypted on the spot when none is
   left: the same ciphertext either way (:mod:`afl.crypto.ckks.zeros`).

``encode`` runs before the context is known, so it only checks the declared bound (values that
would overflow the slot budget are refused with an error, never clipped) and keeps float64.
Tags are drawn per run: a daemon restarted between SendAggregateTags and its uploads cannot
resume the round (the server keeps the first tags; the round then times out and is re-planned).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from numpy.typing import NDArray

from afl.client.daemon.background import Background
from afl.client.daemon.rpc import STAGE_POLL_CAP_S
from afl.client.daemon.transport import DaemonError, RemoteCallError
from afl.client.modes.base import RoundSession, UploadRecord, skipped_record, upload_record
from afl.client.payloads.stats import PayloadError, SlotPayload, encode_float64
from afl.core.packing import packed_length
from afl.crypto.ckks import params as cp
from afl.crypto.ckks import scheme as ckks
from afl.crypto.ckks.wire import CKKS_CONTEXT_CONTEXT, context_fields, seal_tags
from afl.crypto.ckks.zeros import ZeroPool
from afl.crypto.errors import CryptoError
from afl.crypto.identity.signatures import load_public_key_raw, verify_fields
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = [
    "CkksMode",
    "ContextPrefetch",
    "ZeroFiller",
    "ciphertexts_for",
    "fetch_public_context",
]

log = logging.getLogger(__name__)


def _poll_context(
    session: RoundSession, deadline_s: float, stop: threading.Event
) -> pb.CkksContextAnnouncement:
    rpc = session.rpc
    delay, start = rpc.retry.initial_s, time.monotonic()
    while True:
        try:
            announcement: pb.CkksContextAnnouncement = rpc.call(
                "GetCkksContext", cpb.RoundRef(round_id=session.round_id)
            )
            return announcement
        except RemoteCallError as exc:
            if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            if time.monotonic() - start >= deadline_s:
                raise ContextNotPublished(
                    "the decryptor published no CKKS context in time"
                ) from exc
            if stop.wait(delay):
                raise DaemonError(
                    "the round ended before the decryptor published its context"
                ) from exc
            delay = min(2 * delay, STAGE_POLL_CAP_S)  # the decryptor is usually moments away


class ContextNotPublished(DaemonError):
    """The coordinator holds no CKKS context from the decryptor (yet)."""


#: The most bytes a site downloads as the public context (the vetted parameters' is ≈ 262 kB).
CONTEXT_MAX_BYTES = 4 << 20


def fetch_public_context(
    session: RoundSession,
    peers: Mapping[str, bytes],
    *,
    stop: threading.Event | None = None,
    wait_s: float | None = None,
) -> tuple[Any, pb.CkksContextAnnouncement]:
    """Steps 1-2 of the module docstring: the verified public context and its announcement
    (``stop`` set: a fetch still waiting for the decryptor gives up; ``wait_s``: how long to
    wait for the decryptor to publish, default the upload timeout, 0 asks once)."""
    wait = session.rpc.timing.upload_timeout_s if wait_s is None else wait_s
    ann = _poll_context(session, wait, stop or threading.Event())
    decryptor = ann.decryptor_site_id
    if session.ckks_decryptor is None:
        raise DaemonError("no CKKS decryptor is pinned in this site's [policy] ckks_decryptor")
    if decryptor != session.ckks_decryptor:
        raise DaemonError(
            f"the CKKS context comes from {decryptor!r}, not from the decryptor pinned in this "
            f"site's policy ({session.ckks_decryptor!r})"
        )
    if decryptor == session.site_id or decryptor not in peers:
        raise DaemonError(f"the CKKS decryptor {decryptor!r} is not a peer in this site's kit")
    if ann.round_id not in ("", session.round_id):
        raise DaemonError("the CKKS context announcement belongs to another round")
    try:
        verify_fields(
            load_public_key_raw(peers[decryptor]),
            ann.signature,
            context=CKKS_CONTEXT_CONTEXT,
            fields=context_fields(
                round_id=ann.round_id,
                context_sha256=ann.context_sha256,
                cipher_public_key=ann.cipher_public_key,
            ),
        )
    except CryptoError as exc:
        raise DaemonError("the CKKS context announcement is not signed by the decryptor") from exc
    data = session.rpc.download(
        pb.DownloadRequest(round_id=session.round_id, kind=pb.PAYLOAD_KIND_CKKS_PUBLIC_CONTEXT),
        max_bytes=CONTEXT_MAX_BYTES,
    )
    if hashlib.sha256(data).digest() != ann.context_sha256:
        raise DaemonError("the downloaded CKKS context differs from the signed announcement")
    try:
        return ckks.load_public_context(data), ann
    except CryptoError as exc:
        raise DaemonError(f"unacceptable CKKS context: {exc}") from exc


#: The most encryptions of zero a site keeps drawn ahead (131 kB each: 32 MiB; a d = 1024
#: training round over 8 classes takes 65 for its Gram and one per class vector).
ZERO_POOL_CAPACITY = 256
#: A context fetch that failed is tried again after this long, doubling to ``ZERO_RETRY_MAX_S``
#: (one ``GetCkksContext`` a try: a federation whose decryptor never publishes costs a call a
#: minute).
ZERO_RETRY_S = 1.0
ZERO_RETRY_MAX_S = 60.0
#: After a round, a serving site waits this long before it draws again, so that the round's
#: last steps (other parties', on a shared machine) do not compete with the drawing.
ZERO_REFILL_AFTER_S = 2.0
#: How long :meth:`ZeroFiller.close` waits for its thread.
ZERO_CLOSE_WAIT_S = 2.0


def ciphertexts_for(*, dim: int, classes: int) -> int:
    """The ciphertexts of a training round's uploads: the Gram's packed upper triangle and one
    class vector of ``dim`` values for each of ``classes`` classes."""
    return cp.num_ciphertexts(packed_length(dim)) + classes * cp.num_ciphertexts(dim)


class ZeroFiller:
    """Encryptions of zero drawn while the site waits for a round
    (:class:`afl.crypto.ckks.zeros.ZeroPool`, docs/protocol.md M-237), so that a round's
    exchange only encodes and adds its values.

    A daemon thread fetches and checks the decryptor's context exactly as a round's exchange
    does (:func:`fetch_public_context`: the pinned decryptor's signed announcement, the digest,
    the vetted parameters; one ``GetCkksContext`` a try, then it backs off), then draws up to
    ``want`` (what the site's next round is expected to take). It starts nothing while a round
    runs (:meth:`pause`; what is under way then, one encryption of zero or one fetch, ends),
    and after a round only with ``refill`` (a serving daemon), ``refill_after_s`` later, as many
    as that round asked for at least. A round takes them only under the context it verified
    itself (:meth:`zeros_for`); a pool drawn under another context is dropped and drawn anew
    after the round. The pool lives in the process's memory only, like the statistics it will
    carry. :meth:`close` stops the thread."""

    def __init__(
        self,
        session: RoundSession,
        peers: Mapping[str, bytes],
        *,
        want: int,
        refill: bool = True,
        refill_after_s: float = ZERO_REFILL_AFTER_S,
    ) -> None:
        self._session, self._peers = session, peers
        self._want = max(0, min(int(want), ZERO_POOL_CAPACITY))
        self._refill, self._refill_after_s = refill, refill_after_s
        self._not_before = 0.0  # monotonic time before which nothing starts (after a round)
        self._pool: ZeroPool | None = None
        # Rounds that verified another context than the pool's, counted, and that count when
        # the pool was last fetched: they differ while a fetch is due (one under way when a
        # round marks the pool leaves the new mark due).
        self._stale_marks = self._fetched_at = 0
        self._paused = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._asked = 0  # ciphertexts the running round's exchange asked for
        self._thread = threading.Thread(target=self._run, name="ckks-zeros", daemon=True)

    def start(self) -> ZeroFiller:
        self._thread.start()
        return self

    @property
    def context_sha256(self) -> bytes | None:
        """SHA-256 of the context the pool is drawn under (None: none fetched yet)."""
        pool = self._pool
        return pool.context_sha256 if pool is not None else None

    def ready(self) -> int:
        """Encryptions of zero drawn and not yet taken."""
        pool = self._pool
        return len(pool) if pool is not None else 0

    def pause(self) -> None:
        """A round begins: start nothing until :meth:`resume`."""
        self._paused, self._asked = True, 0

    def resume(self) -> None:
        """The round ended: with ``refill``, draw again ``refill_after_s`` from now, as many as
        its exchange asked for at least; without, draw nothing more and drop what is left (a
        daemon that leaves once its run is done)."""
        if not self._refill:
            pool = self._pool
            if pool is not None:
                pool.clear()
            return
        self._want = max(self._want, min(self._asked, ZERO_POOL_CAPACITY))
        self._not_before = time.monotonic() + self._refill_after_s
        self._paused = False
        self._wake.set()

    def zeros_for(self, context_sha256: bytes) -> Callable[[], Any | None]:
        """What :func:`afl.crypto.ckks.scheme.encrypt_block_bytes` takes its encryptions of zero
        from, for a round whose verified context has SHA-256 ``context_sha256``: the pool's,
        each once, while they last and only if the pool was drawn under that context."""
        pool = self._pool
        if pool is None or pool.context_sha256 != context_sha256:
            self._stale_marks += 1  # the decryptor's context changed: fetched anew after the round

        def take() -> Any | None:
            self._asked += 1
            return pool.take(context_sha256) if pool is not None else None

        return take

    def stop(self) -> None:
        """Stop drawing and drop the pool (a fetch under way ends with its call; the daemon
        closes its channel, then :meth:`join`s the thread, so no thread is inside a gRPC call
        when the interpreter finalizes)."""
        self._stop.set()
        self._wake.set()
        pool = self._pool
        if pool is not None:
            pool.clear()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the stopped thread to end."""
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def close(self) -> None:
        """:meth:`stop`, then :meth:`join` for at most ``ZERO_CLOSE_WAIT_S``."""
        self.stop()
        self.join(ZERO_CLOSE_WAIT_S)

    def _drawing(self) -> bool:
        return not (self._paused or self._stop.is_set())

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # a defect, not a condition: no pool, rounds encrypt on the spot
            if self._stop.is_set():  # e.g. a call on the channel the stopping daemon closed
                log.debug("site=%s: drawing stopped: %r", self._session.site_id, exc)
                return
            log.error("site=%s stopped drawing encryptions of zero: %r", self._session.site_id, exc)

    def _serve(self) -> None:
        delay = ZERO_RETRY_S
        while not self._stop.is_set():
            pool = self._pool
            needs_pool = pool is None or self._stale_marks != self._fetched_at
            full = pool is not None and not needs_pool and len(pool) >= self._want
            if not self._drawing() or full:
                self._wake.wait()  # paused, or the pool is full: resume() or close() wakes it
                self._wake.clear()
                continue
            wait_s = self._not_before - time.monotonic()
            if wait_s > 0:
                self._stop.wait(wait_s)
                continue
            if needs_pool:
                marks = self._stale_marks
                try:
                    ctx, ann = fetch_public_context(
                        self._session, self._peers, stop=self._stop, wait_s=0.0
                    )
                except DaemonError as exc:
                    if self._stop.is_set():
                        return
                    log.log(
                        logging.INFO if isinstance(exc, ContextNotPublished) else logging.WARNING,
                        "site=%s: no CKKS context to draw encryptions of zero under (%s); "
                        "trying again in %.0f s",
                        self._session.site_id,
                        exc,
                        delay,
                    )
                    self._wake.wait(delay)  # close() or the end of a round cuts it short
                    self._wake.clear()
                    delay = min(2 * delay, ZERO_RETRY_MAX_S)
                    continue
                delay = ZERO_RETRY_S
                self._pool = ZeroPool(
                    ctx, context_sha256=ann.context_sha256, capacity=ZERO_POOL_CAPACITY
                )
                self._fetched_at = marks
                continue
            assert pool is not None
            t0 = time.perf_counter()
            drawn = pool.fill(self._want, keep_going=self._drawing)
            log.debug(
                "site=%s drew %d encryptions of zero in %.3f s (%d ready)",
                self._session.site_id,
                drawn,
                time.perf_counter() - t0,
                len(pool),
            )


class ContextPrefetch:
    """Steps 1-2 of the module docstring in a background thread, which the daemon starts once the
    site accepted the plan, so that the exchange encrypts at once (the context is fetched while
    the round reaches its upload stage and the site records it); :meth:`end` stops a fetch still
    waiting for the decryptor and joins it, so no thread outlives the round."""

    def __init__(self, session: RoundSession, peers: Mapping[str, bytes]) -> None:
        self._stop = threading.Event()
        self._task = Background(
            lambda: fetch_public_context(session, peers, stop=self._stop),
            name=f"ckks-context-{session.round_id}",
        )

    def result(self) -> tuple[Any, pb.CkksContextAnnouncement]:
        """The verified context and its announcement; raises what the fetch raised."""
        return self._task.wait()

    def end(self) -> None:
        self._stop.set()
        self._task.error()


def _slot_release(plan: cpb.ReleasePlan, slot: str) -> tuple[float, int]:
    """(prescale, K) of an upload slot: K is the largest member count of its releases."""
    releases = [r for r in plan.releases if (r.upload_name or r.name) == slot]
    if not releases:
        raise PayloadError(f"no release of the plan uses upload slot {slot!r}")
    prescales = {r.encoding.ckks.prescale for r in releases}
    if len(prescales) != 1:
        raise PayloadError(f"releases of slot {slot!r} declare different pre-scales")
    return prescales.pop(), max(len(r.member_site_ids) for r in releases)


class CkksMode:
    """CKKS: encrypted, tagged uploads (see the module docstring)."""

    name: str = "ckks"
    aggregation: int = int(cpb.AGGREGATION_MODE_CKKS)
    first_stage: int = int(pb.ROUND_STAGE_UPLOAD)

    def encode(self, release: cpb.Release, values: NDArray[np.float64]) -> bytes:
        enc = release.encoding
        if enc.dtype != cpb.DTYPE_CKKS_VECTORS or not enc.HasField("ckks"):
            raise PayloadError(f"release {release.name}: CKKS mode needs a CkksEncoding")
        prescale, k = enc.ckks.prescale, len(release.member_site_ids)
        x = np.asarray(values, dtype=np.float64).ravel()
        peak = float(np.max(np.abs(x))) * prescale if x.size else 0.0
        if not np.all(np.isfinite(x)) or peak > cp.per_site_slot_bound(k):
            fix = (
                "eval_max_rows (this site's evaluated rows)"
                if release.kind in wire.EVALUATION_KINDS
                else "ckks_gram_bound / ckks_vector_bound"
            )
            raise PayloadError(
                f"release {release.name}: values exceed the plan's declared bound "
                f"(|x|·prescale = {peak:.4g} > 2^17/{k}); raise [round] {fix} on the server"
            )
        return encode_float64(x)

    def exchange(
        self,
        session: RoundSession,
        payloads: Sequence[SlotPayload],
        *,
        already_complete: Collection[str] = (),
    ) -> list[UploadRecord]:
        plan = session.plan
        start = time.perf_counter()
        fetched = session.ckks_context  # fetched ahead by the daemon (ContextPrefetch)
        ctx, ann = fetched() if fetched else fetch_public_context(session, session.peer_keys)
        session.timings["ckks_context"] = time.perf_counter() - start
        start = time.perf_counter()
        todo = [p for p in payloads if p.slot not in already_complete]
        tags = {p.slot: ckks.new_tag(num_summands=_slot_release(plan, p.slot)[1]) for p in todo}
        if todo:
            message = pb.AggregateTags(
                round_id=session.round_id,
                site_id=session.site_id,
                tags=[pb.TagValue(upload_name=s, value=v) for s, v in tags.items()],
            )
            try:
                binding = wire.tag_binding(
                    plan,
                    plan_sha256=session.plan_sha256,
                    sender=session.site_id,
                    decryptor=ann.decryptor_site_id,
                    decryptor_key=ann.cipher_public_key,
                )
            except wire.WireError as exc:
                raise DaemonError(f"cannot bind the CKKS tags: {exc}") from exc
            sealed = seal_tags(
                message.SerializeToString(), binding=binding, identity_key=session.identity_key
            )
            session.rpc.call(
                "SendAggregateTags",
                pb.SendAggregateTagsRequest(
                    round_id=session.round_id,
                    sealed=wire.sealed_tags_to_proto(sealed, decryptor=ann.decryptor_site_id),
                ),
            )
        session.timings["ckks_tags"] = time.perf_counter() - start
        start = time.perf_counter()
        zeros = session.ckks_zeros(ann.context_sha256) if session.ckks_zeros else None
        sent = _encrypt_and_upload(session, ctx, todo, tags, zeros=zeros)
        session.timings["ckks_encrypt"] = sent.encrypt_s
        session.ckks_counts.update(ciphertexts=sent.ciphertexts, drawn_ahead=sent.drawn_ahead)
        session.timings["ckks_encrypt_and_upload"] = time.perf_counter() - start
        return [
            skipped_record(item) if item.slot in already_complete else sent.records[item.slot]
            for item in payloads
        ]


@dataclass
class _Sent:
    """What :func:`_encrypt_and_upload` sent: the record of each slot, and the seconds spent
    encrypting."""

    records: dict[str, UploadRecord] = field(default_factory=dict)
    encrypt_s: float = 0.0
    ciphertexts: int = 0  # encrypted
    drawn_ahead: int = 0  # of which from an encryption of zero drawn ahead (ZeroFiller)


def _encrypt_and_upload(
    session: RoundSession,
    ctx: Any,
    todo: Sequence[SlotPayload],
    tags: Mapping[str, float],
    *,
    zeros: Callable[[], Any | None] | None = None,
) -> _Sent:
    """Step 4 of the module docstring: encrypt each slot and upload it, the uploads one at a time
    on one worker thread while the next slots are encrypted (the smallest slots first, so the
    class vectors' round trips overlap the Gram's encryption instead of following it). The
    first failed upload stops the encryption and the uploads after it, and is raised; no thread
    outlives the call. ``zeros``: encryptions of zero drawn ahead (:class:`ZeroFiller`)."""
    plan, sent, failed = session.plan, _Sent(), threading.Event()

    def zero() -> Any | None:
        sent.ciphertexts += 1
        drawn = zeros() if zeros is not None else None
        sent.drawn_ahead += drawn is not None
        return drawn

    def upload(item: SlotPayload, packed: bytes) -> UploadRecord | None:
        if failed.is_set():
            return None  # an earlier upload failed: nothing more leaves
        try:
            return upload_record(session, item.slot, item.releases, packed)
        except BaseException:
            failed.set()
            raise

    uploads: list[tuple[str, Future[UploadRecord | None]]] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckks-upload") as uploader:
        try:
            for item in sorted(todo, key=lambda p: len(p.payload)):
                if failed.is_set():
                    break  # raised below
                prescale, k = _slot_release(plan, item.slot)
                values = np.frombuffer(item.payload, dtype="<f8")
                start = time.perf_counter()
                try:
                    blobs = ckks.encrypt_block_bytes(
                        ctx,
                        values,
                        prescale=prescale,
                        num_summands=k,
                        tag=tags[item.slot],
                        zeros=zero,
                    )
                except CryptoError as exc:
                    raise PayloadError(f"slot {item.slot}: {exc}") from exc
                packed = ckks.pack_ciphertexts(blobs)
                sent.encrypt_s += time.perf_counter() - start
                uploads.append((item.slot, uploader.submit(upload, item, packed)))
        except BaseException:
            failed.set()  # an encryption failed: the queued uploads send nothing
            raise
    for slot, future in uploads:  # every upload has ended: the first failure is raised
        record = future.result()
        if record is not None:
            sent.records[slot] = record
    return sent
