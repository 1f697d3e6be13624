"""Signed checkpoints, cosignatures and the witness rule: cosign only a checkpoint that extends
the last one cosigned; two inconsistent checkpoints are kept as evidence."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.identity.signatures import generate_identity_key
from afl.crypto.transparency import checkpoint as checkpoint_module
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
from tests.helpers.calls import record_calls

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


def _counting_verifications(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the witnesses whose cosignature quorum_witnesses verifies, in order."""
    return record_calls(
        monkeypatch, checkpoint_module, "verify_cosignature", lambda k, c: c.witness
    )


def test_stopping_at_the_quorum_counts_only_valid_cosignatures_in_a_fixed_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cp = signed([b"a"]).checkpoint
    good = {n: cosign(SITES[n], witness=n, checkpoint=cp) for n in ["site-2", "site-4", "site-5"]}
    bad = [
        Cosignature("site-1", cp, good["site-2"].signature),  # another site's signature
        Cosignature("site-3", cp, bytes(64)),  # no signature at all
    ]
    offered = [good["site-5"], *bad, good["site-4"], good["site-2"]]
    calls = _counting_verifications(monkeypatch)
    got = quorum_witnesses(cp, offered, witness_keys=SITE_PUBLIC, quorum=2, stop_at_quorum=True)
    # site-1 (bad), site-2, site-3 (bad), site-4: the bad ones are verified and never counted,
    # and site-5 is not verified at all once site-2 and site-4 make the quorum.
    assert got == {"site-2", "site-4"}
    assert calls == ["site-1", "site-2", "site-3", "site-4"]
    # Without stopping, every valid witness; the bad ones never reach a quorum of 4.
    assert quorum_witnesses(cp, offered, witness_keys=SITE_PUBLIC, quorum=3) == set(good)
    with pytest.raises(CheckpointError, match="cosigned by 3 witness"):
        quorum_witnesses(cp, offered, witness_keys=SITE_PUBLIC, quorum=4, stop_at_quorum=True)


def test_the_cache_of_verified_cosignatures_skips_only_those_that_verified_under_that_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cp = signed([b"a", b"b"]).checkpoint
    good = [cosign(SITES[n], witness=n, checkpoint=cp) for n in ["site-1", "site-2"]]
    forged = Cosignature("site-3", cp, good[0].signature)
    verified: set[tuple[Cosignature, bytes]] = set()
    calls = _counting_verifications(monkeypatch)
    with pytest.raises(CheckpointError, match="cosigned by 2 witness"):
        quorum_witnesses(cp, [*good, forged], witness_keys=SITE_PUBLIC, quorum=3, verified=verified)
    assert calls == ["site-1", "site-2", "site-3"]
    assert {c for c, _ in verified} == set(good)  # never the forged one
    calls.clear()
    assert quorum_witnesses(
        cp, [*good, forged], witness_keys=SITE_PUBLIC, quorum=2, verified=verified
    ) == {"site-1", "site-2"}
    assert calls == ["site-3"]  # the forged one is verified (and refused) again
    # A cached entry counts only under the key it verified with: a roster that maps site-1 to
    # another key verifies (and refuses) it.
    calls.clear()
    other = {**SITE_PUBLIC, "site-1": generate_identity_key().public_key()}
    with pytest.raises(CheckpointError, match="cosigned by 1 witness"):
        quorum_witnesses(cp, good, witness_keys=other, quorum=2, verified=verified)
    assert calls == ["site-1"]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from(["good", "bad", "other", "outsider", "missing"]), min_size=5,
             max_size=5),
    st.lists(st.integers(0, 4), max_size=6),
    st.integers(1, 5),
    st.randoms(use_true_random=False),
)  # fmt: skip
def test_stopping_at_the_quorum_agrees_with_counting_every_cosignature(
    kinds: list[str], duplicates: list[int], quorum: int, rng: random.Random
) -> None:
    """Whatever mix of valid, forged, misplaced and outside cosignatures (in any order, some
    repeated) is offered: stopping early raises exactly when counting all does, and otherwise
    returns ``quorum`` of the witnesses counting all finds; a warm cache changes nothing."""
    cp = signed([b"x"]).checkpoint
    other_cp = signed([b"x", b"y"]).checkpoint
    names = sorted(SITES)
    offered: list[Cosignature] = []
    for name, kind in zip(names, kinds, strict=True):
        if kind == "good":
            offered.append(cosign(SITES[name], witness=name, checkpoint=cp))
        elif kind == "bad":
            offered.append(cosign(generate_identity_key(), witness=name, checkpoint=cp))
        elif kind == "other":
            offered.append(cosign(SITES[name], witness=name, checkpoint=other_cp))
        elif kind == "outsider":
            offered.append(cosign(SITES[name], witness=f"x-{name}", checkpoint=cp))
    offered += [offered[i] for i in duplicates if i < len(offered)]
    rng.shuffle(offered)
    valid = {n for n, k in zip(names, kinds, strict=True) if k == "good"}

    def outcome(
        *, stop: bool = False, cache: set[tuple[Cosignature, bytes]] | None = None
    ) -> frozenset[str] | None:
        try:
            return quorum_witnesses(
                cp, offered, witness_keys=SITE_PUBLIC, quorum=quorum, stop_at_quorum=stop,
                verified=cache,
            )  # fmt: skip
        except CheckpointError:
            return None

    every = outcome()
    assert every == (frozenset(valid) if len(valid) >= quorum else None)
    cache: set[tuple[Cosignature, bytes]] = set()
    for _ in range(2):  # a cold cache, then a warm one
        early = outcome(stop=True, cache=cache)
        if every is None:
            assert early is None
        else:
            assert early is not None and len(early) == quorum and early <= every
            assert early == frozenset(sorted(valid)[:quorum])  # the fixed order
