"""Canonical, injective byte encoding of field tuples, used for signatures, HKDF info and AEAD
associated data (docs/protocol.md §5: domain separation).

Encoding of a tuple (f_1, ..., f_m):

    u32be(m) || for each field: tag (1 byte) || u64be(len(payload)) || payload

with tag ``b"B"`` for bytes (payload as is), ``b"S"`` for str (UTF-8) and ``b"I"`` for int
(minimal signed big-endian two's complement). Every field is length-prefixed and typed, so two
different tuples never encode to the same bytes (e.g. ("ab", "c") vs ("a", "bc"), or "1" vs 1).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

__all__ = ["DOMAIN_TAG", "Field", "canonical_encode", "canonical_encode_each"]

#: Domain-separation tag bound into every HKDF info, signature and AEAD associated data (it names
#: the protocol family and its version; the wire version is afl.proto.wire.PROTOCOL_VERSION).
DOMAIN_TAG = "afl-secagg/1"

Field = bytes | str | int


def _int_payload(value: int) -> bytes:
    length = (value + (value < 0)).bit_length() // 8 + 1
    return value.to_bytes(length, "big", signed=True)


def _encode_field(i: int, field: Field) -> bytes:
    if isinstance(field, bool):
        raise TypeError(f"field {i}: bool is not a canonical field type; use int or str")
    if isinstance(field, bytes):
        tag, payload = b"B", field
    elif isinstance(field, str):
        tag, payload = b"S", field.encode("utf-8")
    elif isinstance(field, int):
        tag, payload = b"I", _int_payload(field)
    else:
        raise TypeError(f"field {i}: expected bytes, str or int, got {type(field).__name__}")
    return tag + struct.pack(">Q", len(payload)) + payload


def canonical_encode(fields: Sequence[Field]) -> bytes:
    """Encode ``fields`` injectively as described in the module docstring.

    Raises:
        TypeError: a field is not bytes, str or int (bool is rejected as ambiguous).
    """
    if isinstance(fields, bytes | str):
        raise TypeError("fields must be a sequence of fields, not a single bytes/str value")
    parts: list[bytes] = [struct.pack(">I", len(fields))]
    parts += [_encode_field(i, field) for i, field in enumerate(fields)]
    return b"".join(parts)


def canonical_encode_each(
    head: Sequence[Field], each: Sequence[Field], tail: Sequence[Field]
) -> list[bytes]:
    """``[canonical_encode([*head, x, *tail]) for x in each]``, with ``head`` and ``tail`` encoded
    once: many messages that differ in one field (e.g. every survivor's consistency signature,
    each over the whole survivor list) cost O(len(head) + len(tail) + len(each)), not their
    product."""
    for name, part in (("head", head), ("each", each), ("tail", tail)):
        if isinstance(part, bytes | str):
            raise TypeError(f"{name} must be a sequence of fields, not a single bytes/str value")
    count = struct.pack(">I", len(head) + 1 + len(tail))
    before = count + b"".join(_encode_field(i, f) for i, f in enumerate(head))
    after = b"".join(_encode_field(len(head) + 1 + i, f) for i, f in enumerate(tail))
    return [before + _encode_field(len(head), x) + after for x in each]
