"""Per-class aggregation law and solve (paper eq. 13-15, Theorem 1) and the `global` policy.

``per-class`` (paper-exact): ``w_c = (Σ_{k∈S_c} G_k + γI)⁻¹ Σ_{k∈S_c} b_{k,c}``. Classes with the
same coverage set S_c share one Cholesky factorisation, solved for several right-hand sides.

``global`` (hardened default, docs/method.md §1, docs/protocol.md §6): one Gram sum over all
participants for every class, ``w_c = (Σ_k G_k + γI)⁻¹ Σ_k b_{k,c}`` where non-labelling clients
contribute b = 0. The server then learns a single Gram sum and no coverage sets.

The server only ever sees sums (``AggregationPlan`` names them); ``solve_from_sums`` turns the
released sums into W, so plaintext, masked and encrypted modes share one solve.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from afl.core.stats import LocalStats

GramScope = Literal["per-class", "global"]
GRAM_SCOPES: tuple[GramScope, ...] = ("per-class", "global")

Cover = frozenset[int]


class AggregationError(ValueError):
    """The statistics cannot be aggregated or solved (shape mismatch, no contributor, not PD)."""


@dataclass(frozen=True)
class AggregationPlan:
    """Which Gram sums the solve needs and which Gram sum each class uses.

    ``class_cover[c]`` is the set of clients whose b_{k,c} enters b_c (S_c); ``gram_cover[c]`` is
    the set whose Gram enters A_c (S_c for per-class, all participants for global).
    """

    gram_scope: GramScope
    participants: Cover
    class_cover: tuple[Cover, ...]
    gram_cover: tuple[Cover, ...]

    @property
    def gram_releases(self) -> tuple[Cover, ...]:
        """Distinct non-empty Gram sums, in first-use order: one Cholesky each."""
        seen: dict[Cover, None] = {}
        for cover in self.gram_cover:
            if cover:
                seen.setdefault(cover, None)
        return tuple(seen)

    @property
    def uncovered_classes(self) -> tuple[int, ...]:
        """Classes no client could contribute to: their weights are left at zero."""
        return tuple(c for c, cover in enumerate(self.class_cover) if not cover)


def plan_aggregation(contributes: NDArray[np.bool_], *, gram_scope: GramScope) -> AggregationPlan:
    """Coverage sets from the (K, C) matrix of which client contributes b for which class."""
    if gram_scope not in GRAM_SCOPES:
        raise AggregationError(f"gram_scope must be one of {GRAM_SCOPES}, got {gram_scope!r}")
    contributes = np.asarray(contributes, dtype=bool)
    if contributes.ndim != 2:
        raise AggregationError(f"contributes must be (K, C), got {contributes.shape}")
    participants: Cover = frozenset(range(contributes.shape[0]))
    class_cover = tuple(
        frozenset(int(k) for k in np.flatnonzero(contributes[:, c]))
        for c in range(contributes.shape[1])
    )
    if gram_scope == "per-class":
        gram_cover = class_cover
    else:
        gram_cover = tuple(participants if cover else frozenset() for cover in class_cover)
    return AggregationPlan(gram_scope, participants, class_cover, gram_cover)


def sum_members(arrays: Sequence[NDArray[np.float64]], members: Cover) -> NDArray[np.float64]:
    """Plaintext Σ_{k∈members} arrays[k] (the oracle the secure modes are checked against)."""
    if not members:
        raise AggregationError("cannot sum over an empty set of clients")
    ordered = sorted(members)
    total = np.array(arrays[ordered[0]], dtype=np.float64, copy=True)
    with np.errstate(over="ignore"):  # an overflow gives ±inf, which the solve refuses
        for k in ordered[1:]:
            total += arrays[k]
    return total


def class_b_sums(plan: AggregationPlan, bs: Sequence[NDArray[np.float64]]) -> NDArray[np.float64]:
    """b_c = Σ_{k∈S_c} b_{k,c} for every class (eq. 14); zero for uncovered classes."""
    d, num_classes = bs[0].shape
    out = np.zeros((d, num_classes), dtype=np.float64)
    for c, cover in enumerate(plan.class_cover):
        for k in cover:
            out[:, c] += bs[k][:, c]
    return out


def load_solver() -> None:
    """Import the solver's scipy modules now (about 0.1 s): a daemon that will solve does it in a
    thread at start, so that its first solve, under the coordinator's lock while every site
    waits for the model, does not pay for it. Importing this module loads no scipy."""
    import scipy.linalg  # noqa: F401


def factor_regularised(
    gram_sum: NDArray[np.float64], gamma: float
) -> tuple[NDArray[np.float64], bool]:
    """Cholesky factor of Σ G + γI (float64; never an explicit inverse)."""
    from scipy.linalg import LinAlgError, cho_factor  # on demand: `afl --help` never loads scipy

    a = gram_sum + gamma * np.eye(gram_sum.shape[0])
    if not np.all(np.isfinite(a)):
        raise AggregationError("Σ G + γI has NaN or infinite entries (overflow?); cannot solve")
    try:
        return cho_factor(a, lower=False, check_finite=True)  # type: ignore[no-any-return]
    except LinAlgError as exc:
        raise AggregationError(
            f"Σ G + γI is not positive definite (γ={gamma}); check the statistics"
        ) from exc


def solve_from_sums(
    plan: AggregationPlan,
    *,
    gram_sums: Mapping[Cover, NDArray[np.float64]],
    b_sums: NDArray[np.float64],
    gamma: float,
) -> NDArray[np.float64]:
    """Eq. 15 (and its global variant): W (d, C) from the released sums.

    One Cholesky factorisation per distinct Gram release; all classes that use it are solved as
    right-hand sides of the same factor. Non-finite sums (an overflowed sum) or a non-finite W
    raise :class:`AggregationError`, never a bare scipy ValueError.
    """
    if gamma <= 0:
        raise AggregationError(f"γ must be positive, got {gamma}")
    d, num_classes = b_sums.shape
    if num_classes != len(plan.class_cover):
        raise AggregationError(
            f"b_sums has {num_classes} classes, plan has {len(plan.class_cover)}"
        )
    if not np.all(np.isfinite(b_sums)):
        raise AggregationError("the class vector sums hold NaN or infinite values; cannot solve")
    from scipy.linalg import cho_solve

    weights = np.zeros((d, num_classes), dtype=np.float64)
    for cover in plan.gram_releases:
        if cover not in gram_sums:
            raise AggregationError(f"missing the Gram sum over clients {sorted(cover)}")
        gram = np.asarray(gram_sums[cover], dtype=np.float64)
        if gram.shape != (d, d):
            raise AggregationError(
                f"Gram sum over {sorted(cover)} has shape {gram.shape}, want {(d, d)}"
            )
        classes = [c for c, g in enumerate(plan.gram_cover) if g == cover]
        factor = factor_regularised(gram, gamma)
        weights[:, classes] = cho_solve(factor, b_sums[:, classes], check_finite=True)
    if not np.all(np.isfinite(weights)):
        raise AggregationError("the solve overflowed (W is not finite)")
    return weights


def plaintext_gram_sums(
    plan: AggregationPlan, grams: Sequence[NDArray[np.float64]]
) -> dict[Cover, NDArray[np.float64]]:
    """Every Gram release of the plan, summed in the clear (plaintext mode, simulate, oracles)."""
    return {cover: sum_members(grams, cover) for cover in plan.gram_releases}


def federated_solve(
    stats: Sequence[LocalStats], *, gamma: float, gram_scope: GramScope
) -> tuple[NDArray[np.float64], AggregationPlan]:
    """Round 1 in the clear, in process: plan, sum, solve."""
    if not stats:
        raise AggregationError("no client statistics")
    d = stats[0].d
    if any(s.d != d or s.b.shape != stats[0].b.shape for s in stats):
        raise AggregationError("clients disagree on d or the number of classes")
    plan = plan_aggregation(np.stack([s.contributes for s in stats]), gram_scope=gram_scope)
    gram_sums = plaintext_gram_sums(plan, [s.gram for s in stats])
    b_sums = class_b_sums(plan, [s.b for s in stats])
    return solve_from_sums(plan, gram_sums=gram_sums, b_sums=b_sums, gamma=gamma), plan
