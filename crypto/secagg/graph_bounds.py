"""Security parameters of a sparse masking graph (SecAgg+, Bell et al. CCS 2020; docs/protocol.md
§4.2 "Sparse graph"): the failure probability of a random Harary graph H(n, k) for C colluders
and D drop-outs, and the choice of the degree k and the neighbourhood threshold t_N.

Model. The n sites sit on a ring in a uniformly random order π (:mod:`afl.crypto.secagg.graph`);
each is joined to the k/2 nearest on either side (k even, 2 <= k <= n - 2), so it has k
neighbours and shares its mask key and self-mask seeds t_N-of-(k + 1) among them and itself.
At most C sites collude with the coordinator, a set fixed before π is drawn; the coordinator may
exclude up to D further sites of its choice after seeing the graph (t = n - D is the round
threshold: every stage, and the consistency check, needs n - D sites, so two different survivor
lists cannot both be signed when C + 2D < n, and honest sites reveal one kind of share per peer).
Two events break privacy; their union bound is the failure probability

    P_fail(n, k, t_N, C, D) = n · P[Hyp(n - 1, C, k) >= t_N]                       (E1)
                            + n·(n - k + 1)/2 · P[Hyp(n, C, k) >= k - D]           (E2)

E1: some honest site has t_N colluding neighbours, who together hold t_N shares of both of its
secrets (its input would be unmasked). Its k neighbours are k of the other n - 1 ring positions,
C of which hold colluders under π: a hypergeometric count; union over the n sites.

E2: the honest survivors split into two parts joined by no edge, so the coordinator learns each
part's sum. In H(n, k) an induced subgraph is disconnected iff two disjoint runs of k/2
consecutive ring positions are missing from it (an edge spans at most k/2 positions); to remove
them the adversary needs, within the k positions of the two runs, colluders at all but at most D
of them. Union over the n(n - k + 1)/2 pairs of disjoint runs.

Correctness (a liveness property: failing it aborts the round with nothing released): with D
drop-outs independent of π, every secret that must be reconstructed still has t_N holders when
no site loses more than k - t_N of its neighbours:

    P_abort(n, k, t_N, D) <= n · P[Hyp(n - 1, D, k) >= k - t_N + 1].

Every probability is computed exactly with integers (:func:`hypergeometric_tail`) so the
coordinator and each site derive the same figure bit for bit. :func:`choose_graph` takes the
smallest even k, and for it the smallest t_N, with P_fail <= 2^-σ and P_abort <= 2^-η
(σ = 40, η = 30 by default, the statistical and correctness parameters of Bell et al.); when no
k <= n - 2 qualifies the full graph is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

__all__ = [
    "CORRECTNESS_BITS",
    "SECURITY_BITS",
    "GraphChoice",
    "abort_probability",
    "choose_graph",
    "colluders_for",
    "dropouts_for",
    "failure_probability",
    "hypergeometric_tail",
    "log2_probability",
]

#: Default statistical security σ: P_fail <= 2^-40.
SECURITY_BITS = 40
#: Default correctness η: P_abort <= 2^-30 for drop-outs independent of the graph.
CORRECTNESS_BITS = 30


@lru_cache(maxsize=4096)
def hypergeometric_tail(population: int, successes: int, draws: int, at_least: int) -> Fraction:
    """P[X >= at_least] for X ~ Hyp(population, successes, draws), exactly:

    Σ_{i >= at_least} C(successes, i)·C(population - successes, draws - i) / C(population, draws)
    """
    if not 0 <= successes <= population or not 0 <= draws <= population:
        raise ValueError(
            f"hypergeometric parameters out of range: N={population}, K={successes}, n={draws}"
        )
    if at_least <= 0:
        return Fraction(1)
    top = min(successes, draws)
    numerator = sum(
        math.comb(successes, i) * math.comb(population - successes, draws - i)
        for i in range(at_least, top + 1)
    )
    return Fraction(numerator, math.comb(population, draws))


def _check(n: int, k: int, colluders: int, dropouts: int) -> None:
    if n < 4 or k % 2 or not 2 <= k <= n - 2:
        raise ValueError(
            f"a sparse graph needs n >= 4 and an even degree k in 2..n-2, got {n}, {k}"
        )
    if not 0 <= colluders < n or not 0 <= dropouts < n:
        raise ValueError(f"colluders C={colluders} and drop-outs D={dropouts} must lie in 0..n-1")


def failure_probability(
    *, n: int, degree: int, share_threshold: int, colluders: int, dropouts: int
) -> Fraction:
    """P_fail(n, k, t_N, C, D) of the module docstring (E1 + E2), at most 1."""
    _check(n, degree, colluders, dropouts)
    e1 = n * hypergeometric_tail(n - 1, colluders, degree, share_threshold)
    pairs = Fraction(n * (n - degree + 1), 2)
    e2 = pairs * hypergeometric_tail(n, colluders, degree, degree - dropouts)
    return min(Fraction(1), e1 + e2)


def abort_probability(*, n: int, degree: int, share_threshold: int, dropouts: int) -> Fraction:
    """The bound on P_abort(n, k, t_N, D) of the module docstring, at most 1."""
    _check(n, degree, 0, dropouts)
    tail = hypergeometric_tail(n - 1, dropouts, degree, degree - share_threshold + 1)
    return min(Fraction(1), n * tail)


def log2_probability(p: Fraction) -> float:
    """log2(p) as a float (-inf for p = 0), computed from the exact fraction."""
    if p < 0:
        raise ValueError("a probability is >= 0")
    if p == 0:
        return -math.inf
    return math.log2(p.numerator) - math.log2(p.denominator)


def colluders_for(n: int, fraction: float) -> int:
    """C = ⌈fraction·n⌉ colluders assumed among n sites (rounded up: the safe side)."""
    if not 0.0 <= fraction < 1.0 or not math.isfinite(fraction):
        raise ValueError(f"a colluder fraction lies in [0, 1), got {fraction!r}")
    return min(n - 1, math.ceil(round(fraction * n, 9)))


def dropouts_for(n: int, fraction: float) -> int:
    """D = ⌊fraction·n⌋ drop-outs tolerated among n sites (the round threshold is n - D)."""
    if not 0.0 <= fraction < 0.5 or not math.isfinite(fraction):
        raise ValueError(f"a drop-out fraction lies in [0, 0.5), got {fraction!r}")
    return math.floor(round(fraction * n, 9))


@dataclass(frozen=True)
class GraphChoice:
    """A chosen sparse graph: degree k, neighbourhood threshold t_N, and log2 of its P_fail and
    P_abort bounds for the stated C and D."""

    degree: int
    share_threshold: int
    colluders: int
    dropouts: int
    failure_log2: float
    abort_log2: float


def choose_graph(
    *,
    n: int,
    colluders: int,
    dropouts: int,
    security_bits: int = SECURITY_BITS,
    correctness_bits: int = CORRECTNESS_BITS,
) -> GraphChoice | None:
    """The smallest even k (and for it the smallest t_N) with P_fail <= 2^-σ and
    P_abort <= 2^-η; None when no k <= n - 2 qualifies (use the full graph) or C + 2D >= n
    (the consistency check cannot hold, docs/protocol.md §4.2)."""
    if colluders + 2 * dropouts >= n or n < 4:
        return None
    bound_fail = Fraction(1, 2**security_bits)
    bound_abort = Fraction(1, 2**correctness_bits)
    for k in range(2, n - 1, 2):
        # P_fail falls as t_N grows and P_abort rises: the smallest t_N meeting σ is the only
        # candidate worth checking against η.
        low, high = 2, k
        if (
            failure_probability(
                n=n, degree=k, share_threshold=high, colluders=colluders, dropouts=dropouts
            )
            > bound_fail
        ):
            continue
        while low < high:
            mid = (low + high) // 2
            p = failure_probability(
                n=n, degree=k, share_threshold=mid, colluders=colluders, dropouts=dropouts
            )
            if p <= bound_fail:
                high = mid
            else:
                low = mid + 1
        abort = abort_probability(n=n, degree=k, share_threshold=low, dropouts=dropouts)
        if abort > bound_abort:
            continue
        fail = failure_probability(
            n=n, degree=k, share_threshold=low, colluders=colluders, dropouts=dropouts
        )
        return GraphChoice(
            degree=k,
            share_threshold=low,
            colluders=colluders,
            dropouts=dropouts,
            failure_log2=log2_probability(fail),
            abort_log2=log2_probability(abort),
        )
    return None
