"""An append-only RFC 9162 Merkle tree that keeps its perfect subtrees, so a root or a proof of
any size it holds costs O(log² n) hashes instead of the O(n) of rehashing every leaf
(:mod:`afl.crypto.transparency.merkle` computes from the list of leaves; this module answers the
same questions, bit for bit, for a log that only grows: the federation log, docs/protocol.md §11a).

A tree of n leaves keeps, for every height h, the hash of each complete aligned subtree of 2^h
leaves (``levels[h][i]`` = MTH(D[i·2^h : (i+1)·2^h])): about 2n hashes in all, each computed once,
when the leaf that completes it is appended. The RFC's recursive split (§2.1.1) cuts a tree of
n leaves at k, the largest power of two smaller than n; the left part is always such a complete
aligned subtree, so MTH(D[0:n]) and every hash a PATH or a PROOF asks for is a lookup or a
recursion down the right edge (:meth:`MerkleTree.range_hash`).
"""

from __future__ import annotations

from collections.abc import Iterable

from afl.crypto.transparency.merkle import (
    EMPTY_ROOT,
    HASH_SIZE,
    MerkleProofError,
    node_hash,
    range_path,
    range_subproof,
    split_point,
)

__all__ = ["MerkleTree"]


class MerkleTree:
    """The leaf hashes of an append-only log and its perfect subtrees (module docstring)."""

    def __init__(self, leaves: Iterable[bytes] = ()) -> None:
        self._levels: list[list[bytes]] = [[]]
        self.extend(leaves)

    def __len__(self) -> int:
        return len(self._levels[0])

    @property
    def leaves(self) -> list[bytes]:
        """The leaf hashes, in order (a copy)."""
        return list(self._levels[0])

    def append(self, leaf: bytes) -> None:
        """Add one leaf hash (32 bytes) and every subtree it completes."""
        if len(leaf) != HASH_SIZE:
            raise MerkleProofError(f"a leaf hash has {HASH_SIZE} bytes, not {len(leaf)}")
        node, height = leaf, 0
        while True:
            level = self._levels[height]
            level.append(node)
            if len(level) % 2:
                return
            node, height = node_hash(level[-2], level[-1]), height + 1
            if height == len(self._levels):
                self._levels.append([])

    def extend(self, leaves: Iterable[bytes]) -> None:
        for leaf in leaves:
            self.append(leaf)

    def range_hash(self, lo: int, hi: int) -> bytes:
        """MTH(D[lo:hi]) for a range of the RFC's split of some tree (``hi - lo`` a power of two
        with ``lo`` a multiple of it, or the right part of a split): a lookup, or a recursion
        down the right edge."""
        n = hi - lo
        if n & (n - 1) == 0 and lo % n == 0:  # a complete aligned subtree: kept
            return self._levels[n.bit_length() - 1][lo // n]
        k = split_point(n)
        return node_hash(self.range_hash(lo, lo + k), self.range_hash(lo + k, hi))

    def root(self, size: int | None = None) -> bytes:
        """MTH(D[size]) (§2.1.1) of the first ``size`` leaves (all when None)."""
        n = len(self) if size is None else self._size(size, allow_empty=True)
        return EMPTY_ROOT if n == 0 else self.range_hash(0, n)

    def inclusion_proof(self, index: int, size: int | None = None) -> list[bytes]:
        """PATH(index, D[size]) (§2.1.3.1), as :func:`afl.crypto.transparency.merkle.
        inclusion_proof` of the first ``size`` leaves."""
        n = len(self) if size is None else self._size(size)
        if not 0 <= index < n:
            raise MerkleProofError(f"leaf {index} is not in a tree of size {n}")
        return range_path(index, 0, n, self.range_hash)

    def consistency_proof(self, old_size: int, size: int | None = None) -> list[bytes]:
        """PROOF(old_size, D[size]) (§2.1.4.1), as :func:`afl.crypto.transparency.merkle.
        consistency_proof` of the first ``size`` leaves."""
        n = len(self) if size is None else self._size(size)
        if not 0 < old_size <= n:
            raise MerkleProofError(f"no consistency proof from size {old_size} to size {n}")
        return range_subproof(old_size, 0, n, True, self.range_hash)

    def _size(self, size: int, *, allow_empty: bool = False) -> int:
        if not (0 if allow_empty else 1) <= size <= len(self):
            raise MerkleProofError(f"the tree has {len(self)} leaves, not {size}")
        return size
