"""Merkle tree hashing, inclusion and consistency proofs of RFC 9162 §2.1 (Certificate
Transparency 2.0), SHA-256: the federation log's tree (docs/protocol.md §11a).

Leaves are hashed as ``SHA-256(0x00 || entry)`` and interior nodes as ``SHA-256(0x01 || left ||
right)``; the tree of n leaves splits at k, the largest power of two smaller than n (§2.1.1).
Proof generation follows §2.1.3.1 (PATH) and §2.1.4.1 (PROOF/SUBPROOF); verification follows the
algorithms of §2.1.3.2 and §2.1.4.2 step by step, so a proof from any conforming log verifies here.
Functions work on the list of leaf hashes the log stores, never on the entries themselves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from afl.crypto.errors import CryptoError

__all__ = [
    "EMPTY_ROOT",
    "HASH_SIZE",
    "MerkleProofError",
    "RangeHash",
    "consistency_proof",
    "inclusion_proof",
    "leaf_hash",
    "node_hash",
    "range_path",
    "range_subproof",
    "root_hash",
    "split_point",
    "verify_consistency",
    "verify_inclusion",
]

HASH_SIZE = 32
#: MTH({}) = SHA-256() (§2.1.1).
EMPTY_ROOT = hashlib.sha256(b"").digest()


class MerkleProofError(CryptoError):
    """A proof does not verify, or a request for one is out of range."""


def leaf_hash(entry: bytes) -> bytes:
    """MTH({d(0)}) = SHA-256(0x00 || d(0))."""
    return hashlib.sha256(b"\x00" + entry).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """SHA-256(0x01 || left || right)."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def split_point(n: int) -> int:
    """The largest power of two smaller than n (n > 1)."""
    return 1 << ((n - 1).bit_length() - 1)


def root_hash(leaves: Sequence[bytes]) -> bytes:
    """MTH(D[n]) over leaf hashes (§2.1.1), iteratively: the rightmost subtrees merge last."""
    if not leaves:
        return EMPTY_ROOT
    # Stack of (subtree hash, subtree size): perfect subtrees of decreasing size, as in a
    # compact range; merging them right to left gives the RFC's recursive split.
    stack: list[tuple[bytes, int]] = []
    for h in leaves:
        node, size = h, 1
        while stack and stack[-1][1] == size:
            left, _ = stack.pop()
            node, size = node_hash(left, node), size * 2
        stack.append((node, size))
    node = stack.pop()[0]
    while stack:
        node = node_hash(stack.pop()[0], node)
    return node


def inclusion_proof(leaves: Sequence[bytes], index: int) -> list[bytes]:
    """PATH(m, D[n]) (§2.1.3.1): the audit path of leaf ``index`` in the tree of ``leaves``."""
    n = len(leaves)
    if not 0 <= index < n:
        raise MerkleProofError(f"leaf {index} is not in a tree of size {n}")
    return range_path(index, 0, n, _over(leaves))


def consistency_proof(leaves: Sequence[bytes], old_size: int) -> list[bytes]:
    """PROOF(m, D[n]) (§2.1.4.1): that the tree of the first ``old_size`` leaves is a prefix."""
    n = len(leaves)
    if not 0 < old_size <= n:
        raise MerkleProofError(f"no consistency proof from size {old_size} to size {n}")
    return range_subproof(old_size, 0, n, True, _over(leaves))


#: MTH(D[lo:hi]) of one tree, for ``0 <= lo < hi <= n``: the proofs below ask only for ranges
#: of the RFC's recursive split (:class:`afl.crypto.transparency.tree.MerkleTree` answers the
#: perfect ones from its cache).
RangeHash = Callable[[int, int], bytes]


def _over(leaves: Sequence[bytes]) -> RangeHash:
    return lambda lo, hi: root_hash(leaves[lo:hi])


def range_path(m: int, lo: int, hi: int, mth: RangeHash) -> list[bytes]:
    """PATH(m, D[lo:hi]) (§2.1.3.1), ``m`` relative to ``lo``, with subtree hashes from ``mth``."""
    n = hi - lo
    if n == 1:
        return []
    k = split_point(n)
    if m < k:
        return [*range_path(m, lo, lo + k, mth), mth(lo + k, hi)]
    return [*range_path(m - k, lo + k, hi, mth), mth(lo, lo + k)]


def range_subproof(m: int, lo: int, hi: int, b: bool, mth: RangeHash) -> list[bytes]:
    """SUBPROOF(m, D[lo:hi], b) (§2.1.4.1), with subtree hashes from ``mth``."""
    n = hi - lo
    if m == n:
        return [] if b else [mth(lo, hi)]
    k = split_point(n)
    if m <= k:
        return [*range_subproof(m, lo, lo + k, b, mth), mth(lo + k, hi)]
    return [*range_subproof(m - k, lo + k, hi, False, mth), mth(lo, lo + k)]


def verify_inclusion(
    *, leaf: bytes, index: int, tree_size: int, proof: Sequence[bytes], root: bytes
) -> None:
    """§2.1.3.2: raise :class:`MerkleProofError` unless ``proof`` puts leaf hash ``leaf`` at
    ``index`` of the tree of ``tree_size`` leaves whose root is ``root``."""
    if not 0 <= index < tree_size:
        raise MerkleProofError(f"leaf index {index} is not below the tree size {tree_size}")
    fn, sn = index, tree_size - 1
    r = leaf
    for p in proof:
        _check_hash(p)
        if sn == 0:
            raise MerkleProofError("inclusion proof is longer than the tree allows")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn & 1 == 0 and fn != 0:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise MerkleProofError("inclusion proof is shorter than the tree needs")
    if r != root:
        raise MerkleProofError("inclusion proof does not lead to the signed root")


def verify_consistency(
    *,
    old_size: int,
    new_size: int,
    old_root: bytes,
    new_root: bytes,
    proof: Sequence[bytes],
) -> None:
    """§2.1.4.2: raise :class:`MerkleProofError` unless the tree of ``old_size`` leaves with
    root ``old_root`` is a prefix of the tree of ``new_size`` leaves with root ``new_root``."""
    if not 0 < old_size <= new_size:
        raise MerkleProofError(f"no consistency from size {old_size} to size {new_size}")
    if old_size == new_size:
        if proof:
            raise MerkleProofError("a proof between equal sizes must be empty")
        if old_root != new_root:
            raise MerkleProofError("two different roots for the same tree size")
        return
    path = list(proof)
    if not path:
        raise MerkleProofError("consistency proof is empty")
    for p in path:
        _check_hash(p)
    if old_size & (old_size - 1) == 0:  # a power of two: the old root is the first node
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise MerkleProofError("consistency proof is longer than the trees allow")
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn & 1 == 0 and fn != 0:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise MerkleProofError("consistency proof is shorter than the trees need")
    if fr != old_root:
        raise MerkleProofError("consistency proof does not lead to the old root")
    if sr != new_root:
        raise MerkleProofError("consistency proof does not lead to the new root")


def _check_hash(value: bytes) -> None:
    if len(value) != HASH_SIZE:
        raise MerkleProofError(f"proof node of {len(value)} bytes, expected {HASH_SIZE}")
