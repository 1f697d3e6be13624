"""Tests of afl.crypto.masking: pairwise masks cancel per release, self masks are removable."""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.errors import InvalidSeedError, MaskingError
from afl.crypto.masking import (
    dropout_correction,
    mask_input,
    pairwise_mask,
    ring_sum,
    self_mask,
    unmask_sum,
)

MOD = 2**64


def _pair_seeds(ids: list[str]) -> dict[str, dict[str, bytes]]:
    """seeds[i][j] == seeds[j][i], fresh 32 random bytes per pair."""
    seeds: dict[str, dict[str, bytes]] = {i: {} for i in ids}
    for a, b in itertools.combinations(ids, 2):
        s = os.urandom(32)
        seeds[a][b] = s
        seeds[b][a] = s
    return seeds


def _random_u64(n: int) -> np.ndarray:
    return np.frombuffer(os.urandom(8 * n), dtype=np.uint64).copy()


def _oracle_sum(vectors: list[np.ndarray]) -> list[int]:
    """Σ mod 2^64 with Python ints (independent of numpy's wrapping)."""
    return [sum(int(v[j]) for v in vectors) % MOD for j in range(len(vectors[0]))]


@settings(max_examples=25, deadline=None)
@given(k=st.integers(1, 7), n=st.integers(0, 40), release=st.text(min_size=1, max_size=8))
def test_masked_sum_minus_self_masks_is_plain_sum(k: int, n: int, release: str) -> None:
    ids = [f"site-{i}" for i in range(k)]
    seeds = _pair_seeds(ids)
    selfs = {i: os.urandom(32) for i in ids}
    xs = {i: _random_u64(n) for i in ids}
    ys = {
        i: mask_input(
            encoded=xs[i],
            my_id=i,
            members=ids,
            pairwise_seeds=seeds[i],
            self_seed=selfs[i],
            round_id="r1",
            release=release,
        )
        for i in ids
    }
    total = ring_sum(ys.values(), length=n)
    for i in ids:
        total -= self_mask(self_seed=selfs[i], length=n, round_id="r1", release=release)
    assert total.tolist() == _oracle_sum(list(xs.values()))


def test_pairwise_masks_cancel_and_follow_the_sign_convention() -> None:
    ids = ["c", "a", "b"]  # order of the list must not matter, only the id order
    seeds = _pair_seeds(ids)
    masks = [
        pairwise_mask(
            my_id=i, members=ids, pairwise_seeds=seeds[i], length=16, round_id="r", release="g"
        )
        for i in ids
    ]
    assert _oracle_sum(masks) == [0] * 16
    # "a" is the smallest id: its mask is +PRG(s_ab) + PRG(s_ac).
    only_b = pairwise_mask(
        my_id="a",
        members=["a", "b"],
        pairwise_seeds=seeds["a"],
        length=16,
        round_id="r",
        release="g",
    )
    only_a = pairwise_mask(
        my_id="b",
        members=["a", "b"],
        pairwise_seeds=seeds["b"],
        length=16,
        round_id="r",
        release="g",
    )
    assert _oracle_sum([only_b, only_a]) == [0] * 16
    assert not np.array_equal(only_b, np.zeros(16, dtype=np.uint64))


def test_sub_cohort_masks_cancel_within_the_release_members_only() -> None:
    everyone = [f"s{i}" for i in range(6)]
    seeds = _pair_seeds(everyone)
    cohort = ["s1", "s3", "s4"]  # e.g. the sites that label one class
    masks = [
        pairwise_mask(
            my_id=i, members=cohort, pairwise_seeds=seeds[i], length=8, round_id="r", release="b3"
        )
        for i in cohort
    ]
    assert _oracle_sum(masks) == [0] * 8


def test_releases_and_rounds_get_different_masks() -> None:
    ids = ["a", "b", "c"]
    seeds = _pair_seeds(ids)
    selfseed = os.urandom(32)

    def pm(release: str, round_id: str = "r1") -> np.ndarray:
        return pairwise_mask(
            my_id="b",
            members=ids,
            pairwise_seeds=seeds["b"],
            length=32,
            round_id=round_id,
            release=release,
        )

    def sm(release: str, round_id: str = "r1") -> np.ndarray:
        return self_mask(self_seed=selfseed, length=32, round_id=round_id, release=release)

    assert not np.array_equal(pm("gram"), pm("b_c0"))
    assert not np.array_equal(pm("gram"), pm("gram", "r2"))
    assert not np.array_equal(sm("gram"), sm("b_c0"))
    assert not np.array_equal(sm("gram"), sm("gram", "r2"))
    np.testing.assert_array_equal(pm("gram"), pm("gram"))
    # Masks of one release do not cancel another release's masks.
    cross = [
        pairwise_mask(
            my_id=i,
            members=ids,
            pairwise_seeds=seeds[i],
            length=32,
            round_id="r1",
            release="gram" if i == "a" else "b_c0",
        )
        for i in ids
    ]
    assert _oracle_sum(cross) != [0] * 32


@settings(max_examples=20, deadline=None)
@given(k=st.integers(2, 7), data=st.data())
def test_unmask_with_dropouts_gives_survivors_sum(k: int, data: st.DataObject) -> None:
    ids = [f"h{i}" for i in range(k)]
    n = 12
    seeds = _pair_seeds(ids)
    selfs = {i: os.urandom(32) for i in ids}
    xs = {i: _random_u64(n) for i in ids}
    survivors = data.draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
    uploads = {
        i: mask_input(
            encoded=xs[i],
            my_id=i,
            members=ids,
            pairwise_seeds=seeds[i],
            self_seed=selfs[i],
            round_id="r",
            release="gram",
        )
        for i in survivors
    }
    dropped = [i for i in ids if i not in survivors]
    result = unmask_sum(
        masked_inputs=uploads,
        members=ids,
        self_seeds={i: selfs[i] for i in survivors},
        dropped_pairwise_seeds={d: {s: seeds[d][s] for s in survivors} for d in dropped},
        length=n,
        round_id="r",
        release="gram",
    )
    assert result.tolist() == _oracle_sum([xs[i] for i in survivors])


def test_dropout_correction_equals_survivors_terms() -> None:
    ids = ["a", "b", "c", "d"]
    seeds = _pair_seeds(ids)
    survivors = ["a", "b", "d"]
    of_c: dict[str, Any] = {
        "dropped_id": "c",
        "survivors": survivors,
        "dropped_seeds": seeds["c"],
        "length": 8,
        "round_id": "r",
        "release": "x",
    }
    corr = dropout_correction(**of_c)
    # Each survivor's own mask restricted to the pair {i, c}.
    terms = [
        pairwise_mask(
            my_id=i,
            members=[i, "c"],
            pairwise_seeds=seeds[i],
            length=8,
            round_id="r",
            release="x",
        )
        for i in survivors
    ]
    assert corr.tolist() == _oracle_sum(terms)
    base = np.arange(8, dtype=np.uint64)
    removed = dropout_correction(**of_c, remove_from=base)
    assert removed is base  # in place
    assert removed.tolist() == [(i - c) % 2**64 for i, c in enumerate(corr.tolist())]


def test_uploads_look_uniform_and_uncorrelated_with_inputs() -> None:
    """What the server stores is independent of the inputs (near-zero correlation)."""
    ids = [f"s{i}" for i in range(4)]
    n = 20_000
    seeds = _pair_seeds(ids)
    ramp = np.linspace(0, 2**63, n).astype(np.uint64)  # a strongly structured input
    y = mask_input(
        encoded=ramp,
        my_id="s0",
        members=ids,
        pairwise_seeds=seeds["s0"],
        self_seed=os.urandom(32),
        round_id="r",
        release="g",
    )
    u = y.astype(np.float64) / 2.0**64
    corr = np.corrcoef(u, ramp.astype(np.float64))[0, 1]
    assert abs(corr) < 6 / np.sqrt(n)
    assert abs(u.mean() - 0.5) < 6 * np.sqrt(1 / 12 / n)


def test_errors() -> None:
    ids = ["a", "b", "c"]
    seeds = _pair_seeds(ids)
    with pytest.raises(MaskingError, match="no pairwise seed"):
        pairwise_mask(
            my_id="a",
            members=ids,
            pairwise_seeds={"b": seeds["a"]["b"]},
            length=4,
            round_id="r",
            release="g",
        )
    with pytest.raises(MaskingError, match="not a member"):
        pairwise_mask(
            my_id="z", members=ids, pairwise_seeds=seeds["a"], length=4, round_id="r", release="g"
        )
    with pytest.raises(MaskingError, match="contiguous"):
        pairwise_mask(
            my_id="a",
            members=ids,
            pairwise_seeds=seeds["a"],
            length=4,
            round_id="r",
            release="g",
            out=np.zeros(8, dtype=np.uint64)[::2],
        )
    strided = np.arange(8, dtype=np.uint64)[::2]  # masked in a copy, even with overwrite
    masked = mask_input(
        encoded=strided,
        my_id="a",
        members=ids,
        pairwise_seeds=seeds["a"],
        self_seed=bytes(32),
        round_id="r",
        release="g",
        overwrite=True,
    )
    assert masked.flags.c_contiguous and list(strided) == [0, 2, 4, 6]
    with pytest.raises(MaskingError, match="duplicate"):
        pairwise_mask(
            my_id="a",
            members=["a", "b", "b"],
            pairwise_seeds=seeds["a"],
            length=4,
            round_id="r",
            release="g",
        )
    with pytest.raises(InvalidSeedError):
        pairwise_mask(
            my_id="a",
            members=ids,
            pairwise_seeds={"b": b"x", "c": b"y"},
            length=4,
            round_id="r",
            release="g",
        )
    with pytest.raises(MaskingError, match="release"):
        self_mask(self_seed=os.urandom(32), length=4, round_id="r", release="")
    with pytest.raises(MaskingError, match="length"):
        self_mask(self_seed=os.urandom(32), length=-1, round_id="r", release="g")
    with pytest.raises(MaskingError, match="1-D uint64"):
        mask_input(
            encoded=np.zeros(4, dtype=np.int64),
            my_id="a",
            members=ids,
            pairwise_seeds=seeds["a"],
            self_seed=os.urandom(32),
            round_id="r",
            release="g",
        )
    with pytest.raises(MaskingError, match="shape"):
        ring_sum([np.zeros(3, dtype=np.uint64)], length=4)
    with pytest.raises(MaskingError, match="both dropped and a survivor"):
        dropout_correction(
            dropped_id="a",
            survivors=["a", "b"],
            dropped_seeds=seeds["a"],
            length=4,
            round_id="r",
            release="g",
        )


def test_unmask_errors() -> None:
    ids = ["a", "b"]
    up = {"a": np.zeros(4, dtype=np.uint64)}
    with pytest.raises(MaskingError, match="non-members"):
        unmask_sum(
            masked_inputs={**up, "z": np.zeros(4, dtype=np.uint64)},
            members=ids,
            self_seeds={},
            dropped_pairwise_seeds={"b": {}},
            length=4,
            round_id="r",
            release="g",
        )
    with pytest.raises(MaskingError, match="cover exactly"):
        unmask_sum(
            masked_inputs=up,
            members=ids,
            self_seeds={},
            dropped_pairwise_seeds={},
            length=4,
            round_id="r",
            release="g",
        )
    with pytest.raises(MaskingError, match="self-mask seed"):
        unmask_sum(
            masked_inputs=up,
            members=ids,
            self_seeds={},
            dropped_pairwise_seeds={"b": {"a": os.urandom(32)}},
            length=4,
            round_id="r",
            release="g",
        )
