"""RFC 9162 §2.1 Merkle hashing and proofs, against the Certificate Transparency reference tree,
the RFC's recursive definitions written here independently, and a second library (pymerkle)."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pymerkle import InmemoryTree

from afl.crypto.transparency.merkle import (
    EMPTY_ROOT,
    MerkleProofError,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    root_hash,
    verify_consistency,
    verify_inclusion,
)
from tests.helpers.rfc9162 import ref_mth, ref_path, ref_subproof

#: The reference tree of Certificate Transparency's test data (RFC 6962/9162 hashing): leaf
#: inputs, and the root of the tree of the first n of them.
CT_LEAVES = [
    "",
    "00",
    "10",
    "2021",
    "3031",
    "40414243",
    "5051525354555657",
    "606162636465666768696a6b6c6d6e6f",
]
CT_ROOTS = {
    1: "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    2: "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    3: "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    4: "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    5: "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    6: "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    7: "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    8: "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
}


def pymerkle_root(entries: list[bytes]) -> bytes:
    tree = InmemoryTree(algorithm="sha256")
    for entry in entries:
        tree.append_entry(entry)
    return bytes(tree.get_root())


entries_st = st.lists(st.binary(max_size=24), min_size=1, max_size=70, unique=True)


def test_the_certificate_transparency_reference_roots() -> None:
    entries = [bytes.fromhex(x) for x in CT_LEAVES]
    hashes = [leaf_hash(e) for e in entries]
    assert root_hash([]) == EMPTY_ROOT == hashlib.sha256(b"").digest()
    for n, expected in CT_ROOTS.items():
        assert root_hash(hashes[:n]).hex() == expected


def test_the_reference_tree_proves_every_leaf_and_every_prefix() -> None:
    hashes = [leaf_hash(bytes.fromhex(x)) for x in CT_LEAVES]
    for n in range(1, 9):
        root = bytes.fromhex(CT_ROOTS[n])
        for m in range(n):
            proof = inclusion_proof(hashes[:n], m)
            verify_inclusion(leaf=hashes[m], index=m, tree_size=n, proof=proof, root=root)
        for m in range(1, n + 1):
            verify_consistency(
                old_size=m,
                new_size=n,
                old_root=bytes.fromhex(CT_ROOTS[m]),
                new_root=root,
                proof=consistency_proof(hashes[:n], m),
            )


@settings(max_examples=60, deadline=None)
@given(entries_st)
def test_roots_equal_the_rfc_definition_and_a_second_library(entries: list[bytes]) -> None:
    hashes = [leaf_hash(e) for e in entries]
    assert root_hash(hashes) == ref_mth(entries) == pymerkle_root(entries)


@settings(max_examples=60, deadline=None)
@given(entries_st, st.data())
def test_inclusion_proofs_are_the_rfcs_and_verify(
    entries: list[bytes], data: st.DataObject
) -> None:
    hashes = [leaf_hash(e) for e in entries]
    n = len(entries)
    m = data.draw(st.integers(0, n - 1))
    proof = inclusion_proof(hashes, m)
    assert proof == ref_path(m, entries)
    root = pymerkle_root(entries)
    verify_inclusion(leaf=hashes[m], index=m, tree_size=n, proof=proof, root=root)
    # Any other leaf, index, size or a changed node is refused.
    with pytest.raises(MerkleProofError):
        verify_inclusion(
            leaf=leaf_hash(b"x" + entries[m]), index=m, tree_size=n, proof=proof, root=root
        )
    if n > 1:
        with pytest.raises(MerkleProofError):
            verify_inclusion(leaf=hashes[m], index=(m + 1) % n, tree_size=n, proof=proof, root=root)
        bad = list(proof)
        i = data.draw(st.integers(0, len(bad) - 1))
        bad[i] = bytes([bad[i][0] ^ 1]) + bad[i][1:]
        with pytest.raises(MerkleProofError):
            verify_inclusion(leaf=hashes[m], index=m, tree_size=n, proof=bad, root=root)
        with pytest.raises(MerkleProofError):
            verify_inclusion(leaf=hashes[m], index=m, tree_size=n, proof=proof[:-1], root=root)
    with pytest.raises(MerkleProofError, match="not below the tree size"):
        verify_inclusion(leaf=hashes[m], index=m, tree_size=m, proof=proof, root=root)


@settings(max_examples=60, deadline=None)
@given(entries_st, st.data())
def test_consistency_proofs_are_the_rfcs_and_verify(
    entries: list[bytes], data: st.DataObject
) -> None:
    hashes = [leaf_hash(e) for e in entries]
    n = len(entries)
    m = data.draw(st.integers(1, n))
    proof = consistency_proof(hashes, m)
    assert proof == (ref_subproof(m, entries, True) if m < n else [])
    old_root, new_root = pymerkle_root(entries[:m]), pymerkle_root(entries)
    verify_consistency(old_size=m, new_size=n, old_root=old_root, new_root=new_root, proof=proof)
    if m < n:
        # A log that rewrote an old entry has no proof that verifies.
        forged = [b"forged", *entries[1:]]
        with pytest.raises(MerkleProofError):
            verify_consistency(
                old_size=m,
                new_size=n,
                old_root=old_root,
                new_root=pymerkle_root(forged),
                proof=consistency_proof([leaf_hash(e) for e in forged], m),
            )
        bad = list(proof)
        i = data.draw(st.integers(0, len(bad) - 1))
        bad[i] = bytes([bad[i][0] ^ 1]) + bad[i][1:]
        with pytest.raises(MerkleProofError):
            verify_consistency(
                old_size=m, new_size=n, old_root=old_root, new_root=new_root, proof=bad
            )
        with pytest.raises(MerkleProofError):
            verify_consistency(
                old_size=m, new_size=n, old_root=old_root, new_root=new_root, proof=[]
            )


def test_requests_outside_the_tree_are_refused() -> None:
    hashes = [leaf_hash(b"a"), leaf_hash(b"b")]
    with pytest.raises(MerkleProofError, match="not in a tree of size 2"):
        inclusion_proof(hashes, 2)
    with pytest.raises(MerkleProofError):
        consistency_proof(hashes, 0)
    with pytest.raises(MerkleProofError):
        consistency_proof(hashes, 3)
    root = root_hash(hashes)
    with pytest.raises(MerkleProofError, match="two different roots"):
        verify_consistency(old_size=2, new_size=2, old_root=root, new_root=EMPTY_ROOT, proof=[])
    with pytest.raises(MerkleProofError, match="bytes"):
        verify_inclusion(leaf=hashes[0], index=0, tree_size=2, proof=[b"short"], root=root)
