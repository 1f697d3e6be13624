"""Signed checkpoints, cosignatures and the witness rule: cosign only a checkpoint that extends
the last one cosigned; two inconsistent checkpoints are kept as evidence."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.identity.signatures import generate_identity_key
from afl.crypto.transparency.checkpoint import (
    Checkpoint,
    CheckpointError,
    Cosignature,
    SignedCheckpoint,
    cosign,
    quorum_witnesses,
    sign_checkpoint,
    verify_checkpoint,
    verify_cosignature,
)
from afl.crypto.transparency.merkle import consistency_proof, leaf_hash, root_hash
from afl.crypto.transparency.witness import SplitViewError, WitnessError, witness_checkpoint

FED = "fed-test"
COORDINATOR = generate_identity_key()
SITES = {f"site-{i}": generate_identity_key() for i in range(1, 6)}
SITE_PUBLIC = {name: key.public_key() for name, key in SITES.items()}


def signed(entries: list[bytes], *, federation: str = FED) -> SignedCheckpoint:
    hashes = [leaf_hash(e) for e in entries]
    return sign_checkpoint(COORDINATOR, Checkpoint(federation, len(hashes), root_hash(hashes)))


def proof(entries: list[bytes], old_size: int) -> list[bytes]:
    return consistency_proof([leaf_hash(e) for e in entries], old_size) if old_size else []


def witness(
    previous: SignedCheckpoint | None, offered: SignedCheckpoint, path: list[bytes]
) -> Cosignature:
    return witness_checkpoint(
        witness="site-1",
        key=SITES["site-1"],
        coordinator_key=COORDINATOR.public_key(),
        federation=FED,
        previous=previous,
        offered=offered,
        proof=path,
    )


def test_a_checkpoint_verifies_only_under_the_coordinators_key_and_its_own_fields() -> None:
    cp = signed([b"a", b"b"])
    assert verify_checkpoint(COORDINATOR.public_key(), cp) == cp.checkpoint
    with pytest.raises(CheckpointError, match="not signed by the coordinator"):
        verify_checkpoint(SITES["site-2"].public_key(), cp)
    moved = SignedCheckpoint(Checkpoint(FED, 3, cp.checkpoint.root), cp.signature)
    with pytest.raises(CheckpointError):
        verify_checkpoint(COORDINATOR.public_key(), moved)
    other_fed = SignedCheckpoint(Checkpoint("other", 2, cp.checkpoint.root), cp.signature)
    with pytest.raises(CheckpointError):
        verify_checkpoint(COORDINATOR.public_key(), other_fed)
    # A cosignature is not a checkpoint signature, nor the reverse (separate contexts).
    as_cosig = Cosignature("site-1", cp.checkpoint, cp.signature)
    with pytest.raises(CheckpointError):
        verify_cosignature(COORDINATOR.public_key(), as_cosig)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.binary(max_size=8), min_size=1, max_size=40, unique=True), st.data())
def test_a_witness_cosigns_every_extension_of_what_it_cosigned(
    entries: list[bytes], data: st.DataObject
) -> None:
    m = data.draw(st.integers(1, len(entries)))
    previous = signed(entries[:m])
    first = witness(None, previous, [])
    verify_cosignature(SITE_PUBLIC["site-1"], first)
    second = witness(previous, signed(entries), proof(entries, m))
    assert second.checkpoint.size == len(entries)
    verify_cosignature(SITE_PUBLIC["site-1"], second)


def test_a_log_that_rewrote_history_is_evidence_and_not_cosigned() -> None:
    entries = [b"roster", b"run-1", b"plan-1", b"model-1"]
    previous = signed(entries[:3])
    forked = [b"roster", b"run-1", b"plan-1-other", b"model-1"]
    with pytest.raises(SplitViewError) as caught:
        witness(previous, signed(forked), proof(forked, 3))
    assert caught.value.previous == previous
    assert caught.value.offered.checkpoint.size == 4
    assert "inconsistent checkpoints" in str(caught.value)


def test_a_shrunk_log_and_two_roots_for_one_size_are_split_views() -> None:
    entries = [b"a", b"b", b"c"]
    with pytest.raises(SplitViewError, match="the log shrank"):
        witness(signed(entries), signed(entries[:2]), [])
    with pytest.raises(SplitViewError, match="two roots for one size"):
        witness(signed(entries), signed([b"a", b"b", b"x"]), [])
    # The same checkpoint again is cosigned again (idempotent).
    witness(signed(entries), signed(entries), [])


def test_a_checkpoint_not_from_the_coordinator_or_of_another_federation_is_refused() -> None:
    cp = signed([b"a"])
    forged = SignedCheckpoint(cp.checkpoint, SITES["site-3"].sign(b"x"))
    with pytest.raises(WitnessError, match="not signed by the coordinator"):
        witness(None, forged, [])
    with pytest.raises(WitnessError, match="federation 'other'"):
        witness(None, signed([b"a"], federation="other"), [])


def test_a_quorum_counts_distinct_roster_witnesses_on_exactly_this_checkpoint() -> None:
    cp = signed([b"a", b"b"]).checkpoint
    other = signed([b"a", b"b", b"c"]).checkpoint
    cosigs = [cosign(SITES[n], witness=n, checkpoint=cp) for n in ["site-1", "site-2", "site-3"]]
    assert quorum_witnesses(cp, cosigs, witness_keys=SITE_PUBLIC, quorum=3) == {
        "site-1",
        "site-2",
        "site-3",
    }
    noise = [
        cosigs[0],  # a duplicate counts once
        cosign(SITES["site-4"], witness="site-4", checkpoint=other),  # another checkpoint
        cosign(generate_identity_key(), witness="outsider", checkpoint=cp),  # not in the roster
        Cosignature("site-5", cp, cosigs[1].signature),  # site-2's signature under site-5's name
    ]
    with pytest.raises(CheckpointError, match="cosigned by 3 witness"):
        quorum_witnesses(cp, cosigs + noise, witness_keys=SITE_PUBLIC, quorum=4)
