"""Tests of afl.crypto.canonical: typed, length-prefixed encoding is injective."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from afl.crypto.canonical import DOMAIN_TAG, Field, canonical_encode, canonical_encode_each

fields = st.one_of(st.binary(max_size=12), st.text(max_size=12), st.integers())
tuples = st.lists(fields, max_size=5).map(tuple)


def _decode(data: bytes) -> tuple[object, ...]:
    """Independent decoder (oracle): if it inverts the encoding, the encoding is injective."""
    (count,) = struct.unpack(">I", data[:4])
    pos = 4
    out: list[object] = []
    for _ in range(count):
        tag = data[pos : pos + 1]
        (length,) = struct.unpack(">Q", data[pos + 1 : pos + 9])
        payload = data[pos + 9 : pos + 9 + length]
        assert len(payload) == length
        pos += 9 + length
        if tag == b"B":
            out.append(payload)
        elif tag == b"S":
            out.append(payload.decode("utf-8"))
        elif tag == b"I":
            out.append(int.from_bytes(payload, "big", signed=True))
        else:
            raise AssertionError(f"unknown tag {tag!r}")
    assert pos == len(data), "trailing bytes"
    return tuple(out)


def _typed(t: tuple[object, ...]) -> tuple[tuple[str, object], ...]:
    return tuple((type(v).__name__, v) for v in t)


@given(tuples)
def test_decoder_inverts_encoding(t: tuple[object, ...]) -> None:
    assert _typed(_decode(canonical_encode(t))) == _typed(t)  # type: ignore[arg-type]


@given(tuples, tuples)
def test_distinct_tuples_encode_differently(a: tuple[object, ...], b: tuple[object, ...]) -> None:
    same = _typed(a) == _typed(b)
    assert (canonical_encode(a) == canonical_encode(b)) == same  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("ab", "c"), ("a", "bc")),
        ((b"ab", b"c"), (b"a", b"bc")),
        (("a",), (b"a",)),
        (("1",), (1,)),
        (("",), ()),
        (("a", ""), ("a",)),
        ((0,), (b"\x00",)),
        ((255,), (-1,)),
    ],
)
def test_known_collision_candidates_differ(a: tuple[object, ...], b: tuple[object, ...]) -> None:
    assert canonical_encode(a) != canonical_encode(b)  # type: ignore[arg-type]


@given(st.integers())
def test_int_payload_is_minimal_twos_complement(v: int) -> None:
    enc = canonical_encode([v])
    payload = enc[4 + 9 :]
    assert int.from_bytes(payload, "big", signed=True) == v
    if len(payload) > 1:  # minimal: dropping the first byte changes the value
        assert int.from_bytes(payload[1:], "big", signed=True) != v


def test_rejects_bool_and_other_types() -> None:
    with pytest.raises(TypeError, match="bool"):
        canonical_encode([True])
    with pytest.raises(TypeError, match="float"):
        canonical_encode([1.5])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="sequence"):
        canonical_encode("abc")


def test_protocol_version_is_a_nonempty_string() -> None:
    assert isinstance(DOMAIN_TAG, str)
    assert DOMAIN_TAG


@given(tuples, st.lists(fields, max_size=6), tuples)
def test_encoding_many_messages_that_differ_in_one_field_is_encoding_each(
    head: tuple[Field, ...], each: list[Field], tail: tuple[Field, ...]
) -> None:
    got = canonical_encode_each(head, each, tail)
    assert got == [canonical_encode([*head, x, *tail]) for x in each]


def test_encoding_each_rejects_what_encoding_rejects() -> None:
    with pytest.raises(TypeError, match="bool"):
        canonical_encode_each(["a"], [True], [])
    with pytest.raises(TypeError, match="bool"):
        canonical_encode_each([], ["a"], [False])
    with pytest.raises(TypeError, match="sequence"):
        canonical_encode_each([], "ab", [])
