"""The append-only Merkle tree with kept subtrees gives, at every size it holds, the roots and
proofs of RFC 9162 §2.1 as transcribed independently in tests/helpers/rfc9162.py, and they verify."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.transparency.merkle import (
    EMPTY_ROOT,
    MerkleProofError,
    leaf_hash,
    verify_consistency,
    verify_inclusion,
)
from afl.crypto.transparency.tree import MerkleTree
from tests.helpers.rfc9162 import ref_mth, ref_path, ref_subproof

entries_st = st.lists(st.binary(max_size=16), min_size=1, max_size=70)


@settings(max_examples=60)
@given(entries=entries_st)
def test_every_root_of_a_growing_tree_is_the_rfcs(entries: list[bytes]) -> None:
    tree = MerkleTree()
    assert tree.root() == EMPTY_ROOT
    for n, entry in enumerate(entries, start=1):
        tree.append(leaf_hash(entry))
        assert tree.root() == ref_mth(entries[:n])
    for n in range(len(entries) + 1):  # older sizes, answered from the grown tree
        assert tree.root(n) == ref_mth(entries[:n])


@settings(max_examples=60)
@given(entries=entries_st, data=st.data())
def test_inclusion_proofs_of_any_held_size_are_the_rfcs_and_verify(
    entries: list[bytes], data: st.DataObject
) -> None:
    tree = MerkleTree(leaf_hash(e) for e in entries)
    size = data.draw(st.integers(1, len(entries)), label="size")
    index = data.draw(st.integers(0, size - 1), label="index")
    proof = tree.inclusion_proof(index, size)
    assert proof == ref_path(index, entries[:size])
    verify_inclusion(
        leaf=leaf_hash(entries[index]),
        index=index,
        tree_size=size,
        proof=proof,
        root=ref_mth(entries[:size]),
    )


@settings(max_examples=60)
@given(entries=entries_st, data=st.data())
def test_consistency_proofs_between_held_sizes_are_the_rfcs_and_verify(
    entries: list[bytes], data: st.DataObject
) -> None:
    tree = MerkleTree(leaf_hash(e) for e in entries)
    new = data.draw(st.integers(1, len(entries)), label="new size")
    old = data.draw(st.integers(1, new), label="old size")
    proof = tree.consistency_proof(old, new)
    assert proof == ref_subproof(old, entries[:new], True)
    verify_consistency(
        old_size=old,
        new_size=new,
        old_root=ref_mth(entries[:old]),
        new_root=ref_mth(entries[:new]),
        proof=proof,
    )


def test_a_tree_of_a_thousand_leaves_keeps_about_two_hashes_a_leaf_and_answers_every_size() -> None:
    entries = [i.to_bytes(4, "big") for i in range(1000)]
    tree = MerkleTree(leaf_hash(e) for e in entries)
    assert len(tree) == 1000 and tree.leaves == [leaf_hash(e) for e in entries]
    assert sum(len(level) for level in tree._levels) < 2 * 1000
    for size in (1, 2, 3, 511, 512, 513, 777, 1000):
        assert tree.root(size) == ref_mth(entries[:size])
        assert tree.inclusion_proof(size - 1, size) == ref_path(size - 1, entries[:size])
        assert tree.consistency_proof(size // 2 or 1, size) == ref_subproof(
            size // 2 or 1, entries[:size], True
        )


def test_sizes_the_tree_does_not_hold_and_malformed_leaves_are_refused() -> None:
    tree = MerkleTree(leaf_hash(bytes([i])) for i in range(5))
    with pytest.raises(MerkleProofError, match="has 5 leaves, not 6"):
        tree.root(6)
    with pytest.raises(MerkleProofError, match="has 5 leaves, not 0"):
        tree.inclusion_proof(0, 0)
    with pytest.raises(MerkleProofError, match="leaf 3 is not in a tree of size 3"):
        tree.inclusion_proof(3, 3)
    with pytest.raises(MerkleProofError, match="no consistency proof from size 0"):
        tree.consistency_proof(0, 4)
    with pytest.raises(MerkleProofError, match="no consistency proof from size 5 to size 4"):
        tree.consistency_proof(5, 4)
    with pytest.raises(MerkleProofError, match="32 bytes, not 3"):
        tree.append(b"abc")
    assert len(tree) == 5  # the refused leaf was not added
