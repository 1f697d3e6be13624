"""A data site in CKKS mode (docs/protocol.md §4.3): it encrypts only under a public context whose
announcement the decryptor pinned in its policy signed (key from the kit) and whose bytes match
the signed digest, never under a context holding a secret key; its tags are sealed to the
decryptor alone and signed by the site."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from afl.client.config import TimingConfig
from afl.client.daemon.rpc import CoordinatorClient
from afl.client.daemon.transport import DaemonError, RemoteCallError, RetryPolicy
from afl.client.modes import ckks as ckks_mode
from afl.client.modes.base import RoundSession
from afl.client.modes.ckks import (
    ContextPrefetch,
    ZeroFiller,
    _encrypt_and_upload,
    ciphertexts_for,
    fetch_public_context,
)
from afl.client.payloads.stats import SlotPayload, encode_float64
from afl.crypto import kdf
from afl.crypto.ckks import params as cp
from afl.crypto.ckks import scheme as ckks
from afl.crypto.ckks.wire import (
    CKKS_CONTEXT_CONTEXT,
    TagBinding,
    context_fields,
    open_tags,
    seal_tags,
)
from afl.crypto.ckks.zeros import ZeroPool
from afl.crypto.errors import KeyAgreementError, SignatureError
from afl.crypto.identity import signatures
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

DECRYPTOR_KEY = signatures.generate_identity_key()
PEERS = {"dec": signatures.public_key_to_raw(DECRYPTOR_KEY), "site-1": b"\x01" * 32}


class FakeStub:
    """Serves one announcement and one context (what a possibly malicious server sends)."""

    def __init__(self, announcement: pb.CkksContextAnnouncement, data: bytes) -> None:
        self.announcement, self.data = announcement, data

    def GetCkksContext(self, request: Any, **kw: Any) -> pb.CkksContextAnnouncement:
        return self.announcement

    def Download(self, request: Any, **kw: Any) -> Iterator[pb.UploadChunk]:
        yield pb.UploadChunk(
            chunk_index=0,
            total_chunks=1,
            data=self.data,
            sha256=hashlib.sha256(self.data).digest(),
            total_bytes=len(self.data),
        )


def _announce(data: bytes, *, signer: Any = DECRYPTOR_KEY, site: str = "dec") -> Any:
    digest, cpk = hashlib.sha256(data).digest(), b"\x09" * 32
    fields = context_fields(round_id="", context_sha256=digest, cipher_public_key=cpk)
    return pb.CkksContextAnnouncement(
        decryptor_site_id=site,
        context_sha256=digest,
        cipher_public_key=cpk,
        signature=signatures.sign_fields(signer, context=CKKS_CONTEXT_CONTEXT, fields=fields),
    )


def _session(stub: Any, *, pinned: str | None = "dec") -> RoundSession:
    rpc = CoordinatorClient(
        stub,
        site_id="site-1",
        timing=TimingConfig(rpc_timeout_s=1.0, upload_timeout_s=1.0),
        retry=RetryPolicy(attempts=1, initial_s=0.01),
    )
    return RoundSession(
        rpc=rpc,
        round_id="r1",
        site_id="site-1",
        plan=cpb.ReleasePlan(),
        identity_key=signatures.generate_identity_key(),
        ckks_decryptor=pinned,
    )


def test_verified_public_context_is_accepted(private_ctx: Any) -> None:
    data = ckks.public_context_bytes(private_ctx)
    ctx, ann = fetch_public_context(_session(FakeStub(_announce(data), data)), PEERS)
    assert not ctx.is_private() and ann.decryptor_site_id == "dec"


def test_forged_or_swapped_contexts_are_refused(private_ctx: Any) -> None:
    data = ckks.public_context_bytes(private_ctx)
    impostor = signatures.generate_identity_key()
    cases = {
        "not signed by the decryptor": FakeStub(_announce(data, signer=impostor), data),
        "differs from the signed": FakeStub(_announce(data), data + b"\x00"),
        "not from the decryptor pinned": FakeStub(_announce(data, site="server-friend"), data),
    }
    for message, stub in cases.items():
        with pytest.raises(DaemonError, match=message):
            fetch_public_context(_session(stub), PEERS)
    secret = ckks.private_context_bytes(private_ctx)  # validly announced, but holds the key
    with pytest.raises(DaemonError, match="unacceptable CKKS context"):
        fetch_public_context(_session(FakeStub(_announce(secret), secret)), PEERS)
    with pytest.raises(DaemonError, match="not a peer"):  # a site is never its own decryptor
        stub = FakeStub(_announce(data, site="site-1"), data)
        fetch_public_context(_session(stub, pinned="site-1"), PEERS)


def test_a_context_larger_than_any_vetted_one_is_not_downloaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A coordinator (and a decryptor it colludes with, who signs the announcement) that serves
    a "public context" of more than ckks_mode.CONTEXT_MAX_BYTES: the site refuses the download
    by its declared size, before it holds the bytes, and neither a round nor the zero filler
    uses it."""
    monkeypatch.setattr(ckks_mode, "ZERO_RETRY_S", 0.05)
    huge = b"\x00" * (ckks_mode.CONTEXT_MAX_BYTES + 1)
    with pytest.raises(DaemonError, match=f"exceeds the limit of {ckks_mode.CONTEXT_MAX_BYTES}"):
        fetch_public_context(_session(FakeStub(_announce(huge), huge)), PEERS)
    stub = _CountingStub(_announce(huge), huge)
    stub.published.set()
    filler = ZeroFiller(_session(stub), PEERS, want=2).start()
    try:
        assert _until(lambda: stub.calls >= 2)  # the first try was refused in full
        assert filler.ready() == 0 and filler.context_sha256 is None
    finally:
        filler.close()


def test_only_the_pinned_decryptor_is_accepted(private_ctx: Any) -> None:
    # "site-1" is a peer whose key signs a valid announcement: still not the pinned decryptor.
    data = ckks.public_context_bytes(private_ctx)
    other = signatures.generate_identity_key()
    peers = {**PEERS, "site-2": signatures.public_key_to_raw(other)}
    stub = FakeStub(_announce(data, signer=other, site="site-2"), data)
    with pytest.raises(DaemonError, match="not from the decryptor pinned"):
        fetch_public_context(_session(stub), peers)
    with pytest.raises(DaemonError, match="no CKKS decryptor is pinned"):
        fetch_public_context(_session(FakeStub(_announce(data), data), pinned=None), PEERS)


def test_sealed_tags_open_only_for_the_decryptor_and_binding() -> None:
    recipient = kdf.generate_agreement_key()
    site_key = signatures.generate_identity_key()
    binding = TagBinding(
        federation_id="fed", round_id="r1", round_salt=b"\x05" * 32, plan_sha256=b"\x06" * 32,
        sender="site-1", recipient="dec", recipient_key=kdf.public_key_bytes(recipient),
    )  # fmt: skip
    sealed = seal_tags(b"tags", binding=binding, identity_key=site_key)
    sender = site_key.public_key()
    opened = open_tags(
        sealed, binding=binding, sender_identity=sender, recipient_private_key=recipient
    )
    assert opened == b"tags"
    changes: list[dict[str, Any]] = [{"sender": "site-2"}, {"round_id": "r2"}, {"recipient": "x"}]
    for change in changes:
        with pytest.raises(SignatureError):
            open_tags(
                sealed, binding=dataclasses.replace(binding, **change),
                sender_identity=sender, recipient_private_key=recipient,
            )  # fmt: skip
    with pytest.raises(KeyAgreementError):  # not this decryptor's key
        open_tags(sealed, binding=binding, sender_identity=sender,
                  recipient_private_key=kdf.generate_agreement_key())  # fmt: skip
    with pytest.raises(SignatureError):  # another site's key does not vouch for site-1
        open_tags(sealed, binding=binding,
                  sender_identity=signatures.generate_identity_key().public_key(),
                  recipient_private_key=recipient)  # fmt: skip


class _UploadRpc:
    """Records each upload (slot, bytes); raises ``RemoteCallError`` for the slot ``fail``."""

    def __init__(self, fail: str = "") -> None:
        self.fail = fail
        self.sent: list[tuple[str, bytes]] = []

    def upload(self, data: bytes, *, round_id: str, release_name: str) -> pb.UploadReceipt:
        self.sent.append((release_name, data))
        if release_name == self.fail:
            raise RemoteCallError("upload", grpc.StatusCode.FAILED_PRECONDITION, "round aborted")
        return pb.UploadReceipt(release_name=release_name)


def _upload_session(rpc: _UploadRpc, sizes: dict[str, int]) -> RoundSession:
    plan = cpb.ReleasePlan(round_id="r1")
    for slot in sizes:
        release = plan.releases.add(name=slot, member_site_ids=["site-1", "site-2"])
        release.encoding.ckks.prescale = 1.0
    return RoundSession(
        rpc=rpc,  # type: ignore[arg-type]
        round_id="r1",
        site_id="site-1",
        plan=plan,
        identity_key=signatures.generate_identity_key(),
    )


def _slots(sizes: dict[str, int]) -> list[SlotPayload]:
    rng = np.random.default_rng(1)
    payloads = []
    for slot, n in sizes.items():
        data = encode_float64(rng.uniform(-1.0, 1.0, size=n))
        payloads.append(SlotPayload(slot, (slot,), data, hashlib.sha256(data).hexdigest()))
    return payloads


def test_every_slot_is_encrypted_and_uploaded_smallest_first(private_ctx: Any) -> None:
    """The uploads run on a worker while the next slots are encrypted, the small class vectors
    first; the records come back in the payloads' order, each naming what the server got."""
    ctx = ckks.load_public_context(ckks.public_context_bytes(private_ctx))
    sizes = {"gram": 3 * cp.DATA_SLOTS_PER_CIPHERTEXT, "b[A]": 10, "b[B]": 20}
    rpc = _UploadRpc()
    payloads = _slots(sizes)
    tags = {slot: ckks.new_tag(num_summands=2) for slot in sizes}
    sent = _encrypt_and_upload(_upload_session(rpc, sizes), ctx, payloads, tags)
    assert [slot for slot, _ in rpc.sent] == ["b[A]", "b[B]", "gram"]
    for slot, data in rpc.sent:
        record = sent.records[slot]
        assert record.sha256 == hashlib.sha256(data).hexdigest() and record.bytes == len(data)
        blobs = ckks.unpack_ciphertexts(data)  # what the coordinator parses and checks
        assert len(ckks.deserialize_ciphertexts(ctx, blobs, length=sizes[slot])) == len(blobs)
    assert sent.encrypt_s > 0


def test_the_exchange_takes_its_encryptions_of_zero_from_the_pool_while_they_last(
    private_ctx: Any,
) -> None:
    """M-237: with a pool the exchange's ciphertexts are made from it, each zero once, and the
    rest on the spot; every ciphertext decrypts to its values."""
    ctx = ckks.load_public_context(ckks.public_context_bytes(private_ctx))
    sizes = {"gram": 3 * cp.DATA_SLOTS_PER_CIPHERTEXT, "b[A]": 10, "b[B]": 20}  # 5 ciphertexts
    for drawn in (5, 2):
        pool = ZeroPool(ctx, context_sha256=b"ctx", capacity=8)
        pool.fill(drawn)
        rpc = _UploadRpc()
        tags = {slot: ckks.new_tag(num_summands=2) for slot in sizes}
        take = functools.partial(pool.take, b"ctx")
        payloads = _slots(sizes)
        sent = _encrypt_and_upload(_upload_session(rpc, sizes), ctx, payloads, tags, zeros=take)
        assert (sent.ciphertexts, sent.drawn_ahead, len(pool)) == (5, drawn, 0)
        for slot, data in rpc.sent:
            values = np.frombuffer(next(p for p in payloads if p.slot == slot).payload, "<f8")
            vectors = ckks.deserialize_ciphertexts(
                private_ctx, ckks.unpack_ciphertexts(data), length=sizes[slot]
            )
            lanes = np.concatenate(
                [ckks.decode_lanes(private_ctx, v)[cp.TAG_LANES :] for v in vectors]
            )
            assert np.allclose(lanes[: sizes[slot]], values, atol=1e-6)


def test_a_failed_upload_stops_the_uploads_after_it_and_is_raised(private_ctx: Any) -> None:
    ctx = ckks.load_public_context(ckks.public_context_bytes(private_ctx))
    sizes = {"gram": 2 * cp.DATA_SLOTS_PER_CIPHERTEXT, "b[A]": 10, "b[B]": 20}
    rpc = _UploadRpc(fail="b[A]")
    tags = {slot: ckks.new_tag(num_summands=2) for slot in sizes}
    with pytest.raises(RemoteCallError, match="round aborted"):
        _encrypt_and_upload(_upload_session(rpc, sizes), ctx, _slots(sizes), tags)
    assert [slot for slot, _ in rpc.sent] == ["b[A]"]  # nothing left after the failure


class _NotPublished(grpc.RpcError):  # type: ignore[misc]
    """What the coordinator answers before the decryptor published its context."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self) -> str:
        return "the decryptor has not published its CKKS context yet"


class _LateStub(FakeStub):
    """Refuses ``GetCkksContext`` until ``published`` is set."""

    def __init__(self, announcement: pb.CkksContextAnnouncement, data: bytes) -> None:
        super().__init__(announcement, data)
        self.published = threading.Event()
        self.asked = threading.Event()

    def GetCkksContext(self, request: Any, **kw: Any) -> pb.CkksContextAnnouncement:
        self.asked.set()
        if not self.published.is_set():
            raise _NotPublished()
        return self.announcement


def _waiting_session(stub: Any) -> RoundSession:
    """A session whose context wait is long (the upload timeout): only ``end`` cuts it short."""
    session = _session(stub)
    timing = TimingConfig(rpc_timeout_s=1.0, upload_timeout_s=600.0)
    rpc = CoordinatorClient(stub, site_id="site-1", timing=timing, retry=session.rpc.retry)
    return dataclasses.replace(session, rpc=rpc)


def test_the_context_fetched_ahead_is_the_verified_one_and_waits_for_the_decryptor(
    private_ctx: Any,
) -> None:
    data = ckks.public_context_bytes(private_ctx)
    stub = _LateStub(_announce(data), data)
    prefetch = ContextPrefetch(_waiting_session(stub), PEERS)
    try:
        assert stub.asked.wait(timeout=120)  # polling while the decryptor has not published
        stub.published.set()
        ctx, ann = prefetch.result()
        assert not ctx.is_private() and ann.decryptor_site_id == "dec"
    finally:
        prefetch.end()
    forged = FakeStub(_announce(data, signer=signatures.generate_identity_key()), data)
    refused = ContextPrefetch(_session(forged), PEERS)
    with pytest.raises(DaemonError, match="not signed by the decryptor"):
        refused.result()  # the exchange raises what the fetch found
    refused.end()


def test_ending_the_round_stops_a_fetch_still_waiting_for_the_decryptor(private_ctx: Any) -> None:
    data = ckks.public_context_bytes(private_ctx)
    stub = _LateStub(_announce(data), data)  # never published
    prefetch = ContextPrefetch(_waiting_session(stub), PEERS)
    assert stub.asked.wait(timeout=120)
    prefetch.end()  # returns once the thread ended, long before the 600 s upload timeout
    with pytest.raises(DaemonError, match="round ended before the decryptor published"):
        prefetch.result()


def _until(condition: Callable[[], bool], *, within_s: float = 120.0) -> bool:
    """Whether ``condition`` held within ``within_s`` (generous: a loaded machine is slow)."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_site_draws_encryptions_of_zero_while_it_waits_and_only_for_its_context(
    private_ctx: Any,
) -> None:
    """The filler draws what a round takes under the verified context, starts nothing while a
    round runs (even when woken), draws as many as the last round asked for after it, and gives
    nothing for another context: when the decryptor's context changes, it draws anew under the
    new one after the round."""
    data = ckks.public_context_bytes(private_ctx)
    ann = _announce(data)
    stub = FakeStub(ann, data)
    filler = ZeroFiller(_session(stub), PEERS, want=3, refill_after_s=0.0).start()
    try:
        assert _until(lambda: filler.ready() == 3)
        assert filler.context_sha256 == ann.context_sha256
        filler.pause()  # a round begins
        take = filler.zeros_for(ann.context_sha256)
        taken = [take() for _ in range(5)]
        assert [z is not None for z in taken] == [True, True, True, False, False]
        filler._wake.set()  # woken during the round (as resume or close would wake it)
        time.sleep(0.3)
        assert filler.ready() == 0  # it drew nothing
        filler.resume()  # the round asked for 5: the next one gets 5
        assert _until(lambda: filler.ready() == 5)
        renewed = ckks.public_context_bytes(ckks.create_private_context(n_threads=1))
        stub.announcement, stub.data = _announce(renewed), renewed  # the decryptor's new key
        filler.pause()
        new_digest = stub.announcement.context_sha256
        assert filler.zeros_for(new_digest)() is None and filler.ready() == 5
        filler.resume()
        assert _until(lambda: filler.context_sha256 == new_digest and filler.ready() == 5)
        assert filler.zeros_for(new_digest)() is not None
        assert filler.zeros_for(ann.context_sha256)() is None
    finally:
        filler.close()


def test_a_daemon_that_leaves_after_its_run_draws_only_before_its_first_round(
    private_ctx: Any,
) -> None:
    data = ckks.public_context_bytes(private_ctx)
    filler = ZeroFiller(
        _session(FakeStub(_announce(data), data)), PEERS, want=2, refill=False, refill_after_s=0
    ).start()
    try:
        assert _until(lambda: filler.ready() == 2)
        filler.pause()
        take = filler.zeros_for(hashlib.sha256(data).digest())
        assert take() is not None and take() is not None
        filler.resume()
        time.sleep(0.3)
        assert filler.ready() == 0
    finally:
        filler.close()


def test_a_context_not_yet_published_is_asked_for_once_a_try(
    private_ctx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the decryptor has not published, the idle filler asks once and waits (1 s, doubling
    to a minute; here 30 s) instead of polling as a round does."""
    monkeypatch.setattr(ckks_mode, "ZERO_RETRY_S", 30.0)
    data = ckks.public_context_bytes(private_ctx)
    stub = _CountingStub(_announce(data), data)  # never published
    filler = ZeroFiller(_waiting_session(stub), PEERS, want=2).start()
    try:
        assert stub.asked.wait(timeout=120)
        time.sleep(0.5)
        assert stub.calls == 1 and filler.ready() == 0
    finally:
        filler.close()


class _CountingStub(_LateStub):
    def __init__(self, announcement: pb.CkksContextAnnouncement, data: bytes) -> None:
        super().__init__(announcement, data)
        self.calls = 0

    def GetCkksContext(self, request: Any, **kw: Any) -> pb.CkksContextAnnouncement:
        self.calls += 1
        return super().GetCkksContext(request, **kw)


def test_the_filler_draws_nothing_under_a_forged_context_and_stops_when_closed(
    private_ctx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An announcement the pinned decryptor did not sign: the filler draws nothing, tries again
    (here every 0.05 s), and its thread ends when the daemon closes it."""
    monkeypatch.setattr(ckks_mode, "ZERO_RETRY_S", 0.05)
    data = ckks.public_context_bytes(private_ctx)
    forged = _CountingStub(_announce(data, signer=signatures.generate_identity_key()), data)
    forged.published.set()
    filler = ZeroFiller(_session(forged), PEERS, want=3).start()
    assert _until(lambda: forged.calls >= 2)  # the first try was refused in full
    assert filler.context_sha256 is None and filler.ready() == 0
    take = filler.zeros_for(forged.announcement.context_sha256)
    assert take() is None
    filler.close()
    filler._thread.join(timeout=120)
    assert not filler._thread.is_alive()


def test_a_training_round_takes_its_grams_and_class_vectors_ciphertexts() -> None:
    assert ciphertexts_for(dim=1024, classes=8) == 65 + 8  # 524,800 Gram values, 8,190 a ciphertext
    assert ciphertexts_for(dim=24, classes=3) == 1 + 3
