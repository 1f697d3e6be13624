"""RFC 9162 §2.1 transcribed from its recursive definitions, independently of
:mod:`afl.crypto.transparency.merkle`: the oracle of the Merkle tests."""

from __future__ import annotations

import hashlib

__all__ = ["ref_mth", "ref_path", "ref_subproof"]


def _h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _k(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def ref_mth(d: list[bytes]) -> bytes:
    n = len(d)
    if n == 0:
        return _h(b"")
    if n == 1:
        return _h(b"\x00" + d[0])
    k = _k(n)
    return _h(b"\x01" + ref_mth(d[:k]) + ref_mth(d[k:]))


def ref_path(m: int, d: list[bytes]) -> list[bytes]:
    n = len(d)
    if n == 1:
        return []
    k = _k(n)
    if m < k:
        return [*ref_path(m, d[:k]), ref_mth(d[k:])]
    return [*ref_path(m - k, d[k:]), ref_mth(d[:k])]


def ref_subproof(m: int, d: list[bytes], b: bool) -> list[bytes]:
    n = len(d)
    if m == n:
        return [] if b else [ref_mth(d)]
    k = _k(n)
    if m <= k:
        return [*ref_subproof(m, d[:k], b), ref_mth(d[k:])]
    return [*ref_subproof(m - k, d[k:], False), ref_mth(d[:k])]
