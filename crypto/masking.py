"""Pairwise and self masks in Z_{2^64} per release (Bonawitz et al. CCS'17; docs/protocol.md §4.2).

For a release R with member set M (its cohort) and vector length n, site i uploads

    y_i = x_i + p_i + PRG(b_i; R)  (mod 2^64),
    p_i = Σ_{j∈M, j>i} PRG(s_ij; R) - Σ_{j∈M, j<i} PRG(s_ij; R),

with x_i the fixed-point encoding, s_ij = s_ji the pairwise seed and b_i the self-mask seed.
Ids are ordered as Python strings. The pairwise masks cancel in Σ_{i∈M} y_i, so

    Σ_i x_i = Σ_i y_i - Σ_i PRG(b_i; R)  (mod 2^64)

when every member uploads. If members D drop out after the masks were fixed, the survivors' masks
with them do not cancel; the server reconstructs the dropped sites' pairwise seeds and subtracts
(:func:`dropout_correction`). With a sparse masking graph (SecAgg+) the sums over j run over i's
neighbours in M only; the graph is symmetric, so the masks still cancel in pairs, and a dropped
site's correction covers its surviving neighbours. Every PRG stream is bound to (protocol version, round id, release,
purpose) via the PRG context, so one seed yields unrelated masks for different releases.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from afl.crypto.canonical import DOMAIN_TAG, Field
from afl.crypto.errors import MaskingError
from afl.crypto.prg import add_stream, check_seed

__all__ = [
    "dropout_correction",
    "mask_input",
    "pairwise_mask",
    "ring_sum",
    "self_mask",
    "unmask_sum",
    "unmask_total",
]

U64 = NDArray[np.uint64]


def _context(round_id: str, release: str, purpose: str) -> tuple[Field, ...]:
    for name, value in (("round_id", round_id), ("release", release)):
        if not isinstance(value, str) or not value:
            raise MaskingError(f"{name} must be a non-empty str")
    return (DOMAIN_TAG, "mask", purpose, round_id, release)


def _check_length(length: int) -> int:
    if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 0:
        raise MaskingError(f"length must be an int >= 0, got {length!r}")
    return int(length)


def _check_members(my_id: str, members: Sequence[str]) -> None:
    if len(set(members)) != len(members):
        raise MaskingError("release member list has duplicate ids")
    if my_id not in members:
        raise MaskingError(f"site {my_id!r} is not a member of this release")


def _accumulator(out: U64 | None, n: int) -> U64:
    """``out`` checked to be a writable, contiguous uint64 vector of ``n`` (the streams are added
    into it in place), or a new zero vector."""
    if out is None:
        return np.zeros(n, dtype=np.uint64)
    if (
        out.dtype != np.uint64
        or out.shape != (n,)
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise MaskingError(f"out must be a writable, contiguous uint64 vector of length {n}")
    return out


def ring_sum(arrays: Iterable[U64], *, length: int) -> U64:
    """Σ arrays mod 2^64 (uint64 wrapping addition); zeros(length) for an empty iterable."""
    total = np.zeros(_check_length(length), dtype=np.uint64)
    for a in arrays:
        arr = np.asarray(a)
        if arr.dtype != np.uint64 or arr.shape != total.shape:
            raise MaskingError(f"expected uint64 vectors of shape {total.shape}")
        np.add(total, arr, out=total)
    return total


def pairwise_mask(
    *,
    my_id: str,
    members: Sequence[str],
    pairwise_seeds: Mapping[str, bytes],
    length: int,
    round_id: str,
    release: str,
    out: U64 | None = None,
) -> U64:
    """p_i = Σ_{j>i} PRG(s_ij) - Σ_{j<i} PRG(s_ij) over the release's other members (mod 2^64).

    ``pairwise_seeds`` maps peer id → s_ij; seeds of non-members are ignored, a missing member
    seed raises :class:`MaskingError`. With ``out`` (a uint64 vector of ``length``) p_i is added
    into it and ``out`` is returned (one stream in memory at a time, no extra vector).
    """
    n = _check_length(length)
    _check_members(my_id, members)
    ctx = _context(round_id, release, "pairwise")
    total = _accumulator(out, n)
    for peer in members:
        if peer == my_id:
            continue
        if peer not in pairwise_seeds:
            raise MaskingError(f"no pairwise seed with release member {peer!r}")
        add_stream(
            check_seed(pairwise_seeds[peer], what="pairwise seed"),
            out=total,
            context=ctx,
            subtract=peer < my_id,
        )
    return total


def self_mask(
    *,
    self_seed: bytes,
    length: int,
    round_id: str,
    release: str,
    out: U64 | None = None,
    subtract: bool = False,
) -> U64:
    """PRG(b_i; R): the self mask of one site for one release. With ``out`` (a writable,
    contiguous uint64 vector of ``length``) it is added into it (``subtract``: subtracted) and
    ``out`` is returned."""
    seed = check_seed(self_seed, what="self-mask seed")
    total = _accumulator(out, _check_length(length))
    return add_stream(
        seed, out=total, context=_context(round_id, release, "self"), subtract=subtract
    )


def mask_input(
    *,
    encoded: U64,
    my_id: str,
    members: Sequence[str],
    pairwise_seeds: Mapping[str, bytes],
    self_seed: bytes,
    round_id: str,
    release: str,
    overwrite: bool = False,
) -> U64:
    """y_i = x_i + p_i + PRG(b_i) (mod 2^64) for a flat uint64 encoding x_i, accumulated in one
    vector (``overwrite``: in ``encoded`` itself, which the caller no longer needs)."""
    x = np.asarray(encoded)
    if x.dtype != np.uint64 or x.ndim != 1:
        raise MaskingError("encoded input must be a 1-D uint64 vector (flatten blocks first)")
    n = x.shape[0]
    y = x if overwrite and x.flags.writeable and x.flags.c_contiguous else x.copy()
    pairwise_mask(
        my_id=my_id,
        members=members,
        pairwise_seeds=pairwise_seeds,
        length=n,
        round_id=round_id,
        release=release,
        out=y,
    )
    return self_mask(self_seed=self_seed, length=n, round_id=round_id, release=release, out=y)


def dropout_correction(
    *,
    dropped_id: str,
    survivors: Sequence[str],
    dropped_seeds: Mapping[str, bytes],
    length: int,
    round_id: str,
    release: str,
    remove_from: U64 | None = None,
) -> U64:
    """Σ_{i∈survivors} (survivor i's mask term with dropped site d) (mod 2^64).

    Survivor i added +PRG(s_id) if d > i and -PRG(s_id) if d < i; this sum equals the negated
    pairwise mask of d restricted to the survivors. ``dropped_seeds`` maps survivor id → s_id
    (the server recomputes them from d's reconstructed key). With ``remove_from`` (a writable,
    contiguous uint64 vector of ``length``) the correction is subtracted from it in place, which
    is adding d's pairwise mask, and ``remove_from`` is returned.
    """
    if dropped_id in survivors:
        raise MaskingError(f"site {dropped_id!r} cannot be both dropped and a survivor")
    p_d = pairwise_mask(
        my_id=dropped_id,
        members=[*survivors, dropped_id],
        pairwise_seeds=dropped_seeds,
        length=length,
        round_id=round_id,
        release=release,
        out=remove_from,
    )
    return p_d if remove_from is not None else np.subtract(np.zeros_like(p_d), p_d)


def unmask_sum(
    *,
    masked_inputs: Mapping[str, U64],
    members: Sequence[str],
    self_seeds: Mapping[str, bytes],
    dropped_pairwise_seeds: Mapping[str, Mapping[str, bytes]],
    length: int,
    round_id: str,
    release: str,
    neighbours: Mapping[str, Collection[str]] | None = None,
) -> U64:
    """Σ_{i∈survivors} x_i from survivors' uploads y_i (mod 2^64).

    survivors = keys of ``masked_inputs``; dropped = members - survivors. Needs each survivor's
    self-mask seed b_i and, for each dropped site d, its pairwise seeds with every survivor (with
    a sparse graph, ``neighbours``: with every surviving neighbour of d).
    Raises :class:`MaskingError` if an input or seed is missing or a non-member uploaded.
    """
    n = _check_length(length)
    strangers = set(masked_inputs) - set(members)
    if strangers:
        raise MaskingError(f"uploads from non-members of the release: {sorted(strangers)}")
    survivors = [m for m in members if m in masked_inputs]
    return unmask_total(
        masked_total=ring_sum((masked_inputs[s] for s in survivors), length=n),
        survivors=survivors,
        members=members,
        self_seeds=self_seeds,
        dropped_pairwise_seeds=dropped_pairwise_seeds,
        length=n,
        round_id=round_id,
        release=release,
        neighbours=neighbours,
    )


def unmask_total(
    *,
    masked_total: U64,
    survivors: Sequence[str],
    members: Sequence[str],
    self_seeds: Mapping[str, bytes],
    dropped_pairwise_seeds: Mapping[str, Mapping[str, bytes]],
    length: int,
    round_id: str,
    release: str,
    neighbours: Mapping[str, Collection[str]] | None = None,
) -> U64:
    """:func:`unmask_sum` from Σ_{i∈survivors} y_i already summed (a server keeps the running
    sum, not every upload)."""
    n = _check_length(length)
    if len(set(members)) != len(members):
        raise MaskingError("release member list has duplicate ids")
    if not set(survivors) <= set(members):
        raise MaskingError("survivors must be members of the release")
    alive = set(survivors)
    dropped = [m for m in members if m not in alive]
    if set(dropped_pairwise_seeds) != set(dropped):
        raise MaskingError("dropped_pairwise_seeds must cover exactly the dropped members")
    total = ring_sum([masked_total], length=n)
    for s in survivors:  # each stream subtracted in place: no vector per survivor or drop-out
        if s not in self_seeds:
            raise MaskingError(f"missing the self-mask seed of survivor {s!r}")
        self_mask(
            self_seed=self_seeds[s],
            length=n,
            round_id=round_id,
            release=release,
            out=total,
            subtract=True,
        )
    for d in dropped:
        dropout_correction(
            dropped_id=d,
            survivors=[s for s in survivors if neighbours is None or s in neighbours[d]],
            dropped_seeds=dropped_pairwise_seeds[d],
            length=n,
            round_id=round_id,
            release=release,
            remove_from=total,
        )
    return total
