"""afl.proto.wire, the one mapping between protobuf and the protocol (docs/architecture.md §5):
chunk framing both ways, release lengths, and every MASK message round-tripping unchanged."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.core.packing import packed_length
from afl.crypto.secagg.messages import (
    KIND_MASK_KEY,
    KIND_SELF_MASK,
    AdvertiseKeys,
    ConsistencySignature,
    EncryptedShare,
    KeyDirectory,
    RevealedShare,
    RoutedShares,
    ShareKeysUpload,
    UnmaskRequest,
    UnmaskResponse,
)
from afl.crypto.shamir import PRIME, VALUE_BYTES, Share
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.wire import WireError, WireLimitError, assemble, iter_chunks


def _chunks(data: bytes, size: int, **over: Any) -> list[pb.UploadChunk]:
    """Chunks built by hand (not by the code under test), with header fields overridable."""
    parts = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
    fields: dict[str, Any] = {
        "round_id": "r",
        "release_name": "gram[all]",
        "total_bytes": len(data),
    }
    fields.update(over)
    return [
        pb.UploadChunk(
            chunk_index=i,
            total_chunks=len(parts),
            data=p,
            sha256=hashlib.sha256(data).digest() if i == len(parts) - 1 else b"",
            **fields,
        )
        for i, p in enumerate(parts)
    ]


# --- chunk framing ------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(size=st.integers(0, 5000), chunk=st.integers(1, 1500))
def test_iter_chunks_frames_exactly(size: int, chunk: int) -> None:
    payload = bytes(i % 251 for i in range(size))
    chunks = list(iter_chunks(payload, round_id="r", release_name="x", chunk_bytes=chunk))
    assert b"".join(c.data for c in chunks) == payload
    assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
    assert all(c.total_chunks == len(chunks) and c.total_bytes == size for c in chunks)
    assert all(len(c.data) <= chunk for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(payload).digest()
    assert all(c.sha256 == b"" for c in chunks[:-1])
    assert len(chunks) == wire.chunk_count(size, chunk_bytes=chunk)
    assert assemble(chunks, max_bytes=size, max_chunk_bytes=chunk).data == payload


def test_chunk_size_is_capped_at_one_mib() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(iter_chunks(b"x", round_id="r", release_name="x", chunk_bytes=2 << 20))


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=3000), size=st.integers(1, 700))
def test_any_chunking_reassembles(data: bytes, size: int) -> None:
    upload = assemble(_chunks(data, size), max_chunk_bytes=700, max_bytes=4000)
    assert upload.data == data and upload.sha256 == hashlib.sha256(data).digest()


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=40, max_size=400), seed=st.integers(0, 2**32 - 1))
def test_any_reordering_or_duplication_is_rejected(data: bytes, seed: int) -> None:
    parts = _chunks(data, 10)
    rng = np.random.default_rng(seed)
    order = list(rng.permutation(len(parts)))
    if order == sorted(order):
        order = [order[1], order[0], *order[2:]]
    with pytest.raises(WireError):
        assemble([parts[i] for i in order], max_chunk_bytes=10, max_bytes=1000)
    dup = int(rng.integers(len(parts)))
    with pytest.raises(WireError):
        assemble(
            [*parts[: dup + 1], parts[dup], *parts[dup + 1 :]], max_chunk_bytes=10, max_bytes=1000
        )


def test_chunk_header_and_size_rules() -> None:
    data = bytes(range(100))
    parts = _chunks(data, 30)
    with pytest.raises(WireLimitError, match="declared transfer"):
        wire.ChunkAssembler(max_chunk_bytes=30, max_bytes=99).add(parts[0])
    with pytest.raises(WireLimitError, match="chunk of 30 bytes"):
        wire.ChunkAssembler(max_chunk_bytes=29, max_bytes=1000).add(parts[0])
    changed = _chunks(data, 30, release_name="b[a]")
    with pytest.raises(WireError, match="header"):
        assemble([parts[0], *changed[1:]], max_chunk_bytes=30, max_bytes=1000)
    with pytest.raises(WireError, match="truncated"):
        assemble(parts[:-1], max_chunk_bytes=30, max_bytes=1000)
    with pytest.raises(WireError, match="empty"):
        assemble([], max_chunk_bytes=30, max_bytes=1000)
    with pytest.raises(WireError, match="total_bytes"):
        assemble(_chunks(data, 30, total_bytes=120), max_chunk_bytes=30, max_bytes=1000)
    with pytest.raises(WireError, match="name the round"):
        assemble(_chunks(data, 30, round_id=""), max_chunk_bytes=30, max_bytes=1000)
    anonymous = assemble(
        _chunks(data, 30, round_id="", release_name=""), max_bytes=1000, require_names=False
    )
    assert anonymous.data == data  # downloads of the CKKS context name no round


# --- release lengths ----------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 7, 1024])
def test_release_length_counts_packed_and_dense_elements(d: int) -> None:
    gram = cpb.Release(shape=[d, d], encoding=cpb.Encoding(packing=cpb.PACKING_UPPER_TRIANGLE))
    b = cpb.Release(shape=[d, 3], encoding=cpb.Encoding(packing=cpb.PACKING_DENSE))
    assert wire.release_length(gram) == d * (d + 1) // 2 == packed_length(d)
    assert wire.release_length(b) == 3 * d
    assert wire.release_length(shape=(d, d), packed=True) == d * (d + 1) // 2
    assert wire.release_length(shape=(d, d), packed=False) == d * d


# --- MASK messages ------------------------------------------------------------------------------


def _blob(n: int, tag: int) -> bytes:
    return bytes((tag + i) % 256 for i in range(n))


def test_mask_messages_round_trip_unchanged() -> None:
    advert = AdvertiseKeys("r1", "site-1", _blob(32, 1), _blob(32, 2), _blob(64, 3))
    assert wire.advert_from_proto("site-1", wire.advert_to_proto(advert)) == advert

    directory = KeyDirectory(
        "r1",
        (
            AdvertiseKeys("r1", "site-1", _blob(32, 1), _blob(32, 2), _blob(64, 3)),
            AdvertiseKeys("r1", "site-2", _blob(32, 4), _blob(32, 5), _blob(64, 6)),
        ),
    )
    assert wire.directory_from_proto(wire.directory_to_proto(directory)) == directory

    shares = tuple(EncryptedShare("site-1", f"site-{k}", _blob(90, k)) for k in (2, 3))
    upload = ShareKeysUpload("r1", "site-1", shares)
    assert wire.share_keys_from_proto("site-1", wire.share_keys_to_proto(upload)) == upload

    routed = RoutedShares(
        "r1", "site-2", tuple(EncryptedShare(f"site-{k}", "site-2", _blob(90, k)) for k in (1, 3))
    )
    assert wire.routed_from_proto(wire.routed_to_proto(routed), recipient="site-2") == routed

    signatures = tuple(ConsistencySignature("r1", f"site-{k}", _blob(64, k)) for k in (1, 2, 3))
    request = UnmaskRequest(
        "r1", ("site-1", "site-2", "site-3"), ("site-4",), ("gram[all]",), signatures
    )
    assert wire.unmask_request_from_proto(wire.unmask_request_to_proto(request)) == request

    revealed = (
        RevealedShare("site-1", KIND_SELF_MASK, "gram[all]", Share(index=2, value=PRIME - 1)),
        RevealedShare("site-4", KIND_MASK_KEY, "", Share(index=2, value=12345)),
    )
    response = UnmaskResponse("r1", "site-2", revealed)
    assert (
        wire.unmask_response_from_proto("site-2", wire.unmask_response_to_proto(response))
        == response
    )


def test_the_sender_is_always_the_authenticated_caller() -> None:
    forged = pb.ShareKeysRequest(
        round_id="r1",
        shares=[
            pb.SealedMessage(sender_site_id="site-9", recipient_site_id="site-2", ciphertext=b"x")
        ],
    )
    parsed = wire.share_keys_from_proto("site-1", forged)
    assert parsed.site_id == "site-1" and parsed.shares[0].sender == "site-1"
    advert = wire.advert_from_proto("site-3", pb.AdvertiseKeysRequest(round_id="r1"))
    assert advert.site_id == "site-3"


def test_malformed_mask_messages_are_wire_errors() -> None:
    bad_type = pb.UnmaskResponse(
        round_id="r1",
        shares=[
            pb.RevealedShare(
                owner_site_id="a",
                type=pb.SHARE_TYPE_UNSPECIFIED,
                share=cpb.ShamirShare(x=1, y=b"\x00" * VALUE_BYTES),
            )
        ],
    )
    with pytest.raises(WireError, match="unknown type"):
        wire.unmask_response_from_proto("b", bad_type)
    short = pb.UnmaskResponse(
        round_id="r1",
        shares=[
            pb.RevealedShare(
                owner_site_id="a",
                type=pb.SHARE_TYPE_MASK_KEY,
                share=cpb.ShamirShare(x=1, y=b"\x00"),
            )
        ],
    )
    with pytest.raises(WireError, match="malformed"):
        wire.unmask_response_from_proto("b", short)
    with pytest.raises(WireError, match="survivor list"):
        wire.consistency_from_proto(
            "a", pb.ConsistencySignature(round_id="r1", survivors=["a"]), survivors=("a", "b")
        )
    with pytest.raises(WireError, match="must be 3 uint64"):
        wire.masked_upload("a", "r1", {"b[A]": b"\x00" * 16}, {"b[A]": 3})
    ok = wire.masked_upload("a", "r1", {"b[A]": np.arange(3, dtype="<u8").tobytes()}, {"b[A]": 3})
    assert ok.vectors[0][0] == "b[A]" and ok.vectors[0][1].tolist() == [0, 1, 2]
