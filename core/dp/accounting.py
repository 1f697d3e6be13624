"""The DP rulebook: privacy accounting and noise calibration of the DP mode (docs/protocol.md §7,
docs/architecture.md §6). Pure functions on plain data; every other module calls these.

**Accounting.** A Gaussian release with L2 sensitivity Δ and noise standard deviation σ is μ-GDP
with μ = Δ/σ (Dong, Roth & Su 2019). Releases of the same dataset compose (adaptive or not) into
one μ-GDP mechanism with

    μ² = Σ_j (Δ_j / σ_j)²,   i.e. noise multiplier  z_eff = 1/μ = (Σ_j (Δ_j/σ_j)²)^(-1/2).

μ-GDP is exactly (ε, δ(ε))-DP for every ε with (Balle & Wang 2018, Thm. 8; Dong et al. Cor. 2.13)

    δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2).

ε(δ) is the exact dual, solved here for ε with scipy (``brentq`` on δ(ε) above, to 1e-12; no
subsampling, hence no CLT approximation). opacus' ``eps_from_mu`` computes the same dual
(``backend="opacus"``, or ``"auto"``: opacus when importable); the tests check the two against
each other and against an independent oracle. The daemons use the scipy solve: opacus imports
torch, seconds of CPU in every process that accounts a DP plan. opacus' ``GaussianAccountant`` is
never used: it is a loose CLT approximation for subsampled SGD.

**The releases of a DP round** (:func:`release_groups`, :func:`plan_releases`,
:func:`pseudo_releases`). Classes are grouped by the set of sites that contribute to them: one
group over all participants in ``global`` scope, one group per distinct coverage set S_c in
``per-class`` scope. Each group releases four additive statistics over its members: ``gram``
(d x d), ``s_pos`` and ``t_sum`` (d x C_r) and ``counts`` (n+ and N, 2 x C_r); round 2 of a
two-round run releases the same three label statistics of the pseudo-labelled rows
(``pseudo_s_pos``, ``pseudo_t_sum``, ``pseudo_counts``) over all participants. Their L2
sensitivities to one privacy unit are in :func:`statistic_sensitivity` (a patient of at most m
images, label clipping at k positives: :class:`Mechanism`).

**Noise** (:func:`calibrate_releases`). Release r of kind κ gets σ_r = z·Δ̂_r/√a_κ: a_κ is the
kind's share of the budget (:class:`BudgetSplit`) and Δ̂_r the release's calibration sensitivity,
by default (``joint``) the largest over its members s of √(Σ Δ_{r'}²) over s's releases r' of the
same kind, so that each site's releases of one kind together cost at most a_κ/z² of μ², however
many release groups it is in. z is calibrated so that the worst site meets (ε, δ) over the run
(round 1 reserves round 2's releases). Each site's cost is the exact composition
μ_k² = Σ_{r ∋ k} (Δ_r/σ_r)² (:func:`site_epsilons`). The noise is distributed: each of the n_r
members adds a share of standard deviation σ_r/√(n_r - t_r) (:func:`noise_share`), on the grid
2^-f_r, whose rounding inflates the accounted sensitivity (:func:`grid_frac_bits`,
:func:`grid_inflation`).

**The adversary that sees a site's upload** (:func:`protecting_sigma`). Under secure aggregation
(mask, ckks) the coordinator sees sums only: a site's contribution is protected by the shares of
the n_r - t_r honest members, σ_r. In plaintext the coordinator sees the upload alone: only the
site's own share protects it. A site computes its ε from the share it adds itself, under that
view (:func:`site_view_releases`), never from the noise the coordinator says the sum carries,
and with at least its own number of colluders (:func:`site_colluders`), never only the plan's t_r.

**Lifetime** (:func:`compose_mu`). Every release a site takes part in is μ-GDP for the unit; its
releases over rounds and runs compose exactly into μ² = Σ μ_i² (adaptive composition of GDP),
ε(μ, δ) at the site's lifetime δ. Other mechanisms (Laplace, Skellam, subsampling) would need a
privacy-loss-distribution or Rényi accountant over the same ledger.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Backend = Literal["auto", "opacus", "scipy"]

_OPACUS_MAX_EPS = 500.0  # opacus brackets its root search in [0, 500]


class AccountingError(ValueError):
    """Invalid privacy parameters."""


@dataclass(frozen=True)
class GaussianRelease:
    """One Gaussian mechanism: L2 ``sensitivity`` Δ and noise standard deviation ``sigma`` σ."""

    name: str
    sensitivity: float
    sigma: float

    def __post_init__(self) -> None:
        if not self.sensitivity >= 0:
            raise AccountingError(f"{self.name}: sensitivity must be >= 0, got {self.sensitivity}")
        if not self.sigma >= 0:
            raise AccountingError(f"{self.name}: sigma must be >= 0, got {self.sigma}")


def _check_delta(delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise AccountingError(f"delta must lie in (0, 1), got {delta}")


def mu_from_releases(releases: Sequence[GaussianRelease]) -> float:
    """Composed GDP parameter μ = sqrt(Σ_j (Δ_j/σ_j)²); inf if some σ_j = 0 < Δ_j."""
    total = 0.0
    for r in releases:
        if r.sensitivity == 0:
            continue
        if r.sigma == 0:
            return math.inf
        total += (r.sensitivity / r.sigma) ** 2
    return math.sqrt(total)


def effective_noise_multiplier(releases: Sequence[GaussianRelease]) -> float:
    """z_eff = (Σ_j (Δ_j/σ_j)²)^(-1/2); inf for no (or zero-sensitivity) releases."""
    mu = mu_from_releases(releases)
    return math.inf if mu == 0 else 1.0 / mu


def delta_for_epsilon(*, epsilon: float, mu: float) -> float:
    """δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2) of μ-GDP (Balle & Wang 2018, Thm. 8)."""
    if mu <= 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    # Φ and log Φ are scipy.special's ndtr and log_ndtr (what scipy.stats.norm calls, without
    # importing scipy.stats: on demand, so that importing afl.proto.wire stays light).
    from scipy.special import log_ndtr, ndtr

    a = -epsilon / mu + mu / 2
    b = -epsilon / mu - mu / 2
    # e^ε Φ(b) evaluated in log space: e^ε overflows long before the product does.
    return max(0.0, float(ndtr(a) - math.exp(epsilon + float(log_ndtr(b)))))


def _eps_scipy(mu: float, delta: float) -> float:
    from scipy import optimize

    hi = 1.0
    while delta_for_epsilon(epsilon=hi, mu=mu) > delta:
        hi *= 2.0
    root = optimize.brentq(
        lambda e: delta_for_epsilon(epsilon=e, mu=mu) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12
    )
    return float(root)


def _eps_opacus(mu: float, delta: float) -> float:
    from opacus.accountants.analysis.gdp import eps_from_mu

    return float(eps_from_mu(mu=mu, delta=delta))


def _opacus_available() -> bool:
    try:
        import opacus.accountants.analysis.gdp  # noqa: F401
    except ImportError:
        return False
    return True


def epsilon_from_mu(*, mu: float, delta: float, backend: Backend = "scipy") -> float:
    """Smallest ε such that μ-GDP is (ε, δ)-DP (exact dual, Balle & Wang 2018).

    ``backend``: ``scipy`` (the formula solved here, the default: it imports no torch),
    ``opacus`` (``eps_from_mu``) or ``auto`` (opacus when importable). Returns 0 when μ = 0 or
    δ(0) ≤ δ, inf when μ = inf.
    """
    _check_delta(delta)
    if not mu >= 0:
        raise AccountingError(f"mu must be >= 0, got {mu}")
    if math.isinf(mu):
        return math.inf
    if delta_for_epsilon(epsilon=0.0, mu=mu) <= delta:
        return 0.0
    if backend == "auto":
        backend = "opacus" if _opacus_available() else "scipy"
    if backend == "opacus":
        if delta_for_epsilon(epsilon=_OPACUS_MAX_EPS, mu=mu) > delta:
            return _eps_scipy(mu, delta)  # outside opacus' bracket: ε > 500, no privacy anyway
        return _eps_opacus(mu, delta)
    if backend == "scipy":
        return _eps_scipy(mu, delta)
    raise AccountingError(f"unknown backend {backend!r}")


def epsilon_for_releases(
    releases: Sequence[GaussianRelease], *, delta: float, backend: Backend = "scipy"
) -> float:
    """ε at δ of the composition of ``releases`` of one dataset: ε(μ, δ) with μ from
    :func:`mu_from_releases`."""
    return epsilon_from_mu(mu=mu_from_releases(releases), delta=delta, backend=backend)


def calibrate_noise_multiplier(*, epsilon: float, delta: float, rel_tol: float = 1e-10) -> float:
    """Noise multiplier z = σ/Δ (= 1/μ) of one Gaussian release that is exactly (ε, δ)-DP.

    Bisection on μ of δ(ε; μ) = δ, which is increasing in μ. ε = inf returns 0
    (no noise). For several releases with a common budget, use the result as z_eff.
    """
    _check_delta(delta)
    if math.isnan(epsilon) or epsilon <= 0:
        raise AccountingError(f"epsilon must be > 0, got {epsilon}")
    if math.isinf(epsilon):
        return 0.0
    lo, hi = 0.0, 1.0
    while delta_for_epsilon(epsilon=epsilon, mu=hi) < delta:
        lo, hi = hi, hi * 2.0
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        if delta_for_epsilon(epsilon=epsilon, mu=mid) < delta:
            lo = mid
        else:
            hi = mid
    return 1.0 / lo if lo > 0 else math.inf


def calibrate_sigma(*, epsilon: float, delta: float, sensitivity: float) -> float:
    """σ = z·Δ of one Gaussian release that is (ε, δ)-DP at L2 sensitivity ``sensitivity``."""
    if not sensitivity > 0:
        raise AccountingError(f"sensitivity must be > 0, got {sensitivity}")
    return calibrate_noise_multiplier(epsilon=epsilon, delta=delta) * sensitivity


# ---------------------------------------------------------------------------------------------
# The DP round: its releases, their sensitivities, the noise split and grid, the calibration.
# ---------------------------------------------------------------------------------------------

StatisticKind = Literal[
    "gram", "s_pos", "t_sum", "counts", "pseudo_s_pos", "pseudo_t_sum", "pseudo_counts"
]
BaseKind = Literal["gram", "s_pos", "t_sum", "counts"]
#: The four statistics each release group publishes, in plan order.
STATISTIC_KINDS: tuple[StatisticKind, ...] = ("gram", "s_pos", "t_sum", "counts")
#: The three statistics of the pseudo-labelled rows that round 2 publishes, in plan order.
PSEUDO_KINDS: tuple[StatisticKind, ...] = ("pseudo_s_pos", "pseudo_t_sum", "pseudo_counts")
GRAM_SCOPES = ("global", "per-class")
#: Rounding to the noise grid may inflate a release's sensitivity by at most this fraction.
GRID_INFLATION_MAX = 1e-4
#: A member's noise share spans at least this many grid steps (its standard deviation).
MIN_SHARE_STEPS = 64.0


def base_kind(kind: StatisticKind) -> BaseKind:
    """The round-1 statistic a kind is computed like (``pseudo_s_pos`` -> ``s_pos``...)."""
    base = kind.removeprefix("pseudo_")
    if base not in ("gram", "s_pos", "t_sum", "counts"):
        raise AccountingError(f"unknown statistic kind {kind!r}")
    return base  # type: ignore[return-value]


def statistic_sensitivity(
    kind: StatisticKind,
    *,
    clip_norm: float,
    n_classes: int = 0,
    rows_per_individual: int = 1,
    max_positive_labels: int = 0,
) -> float:
    """L2 sensitivity Δ of one released statistic to one privacy unit.

    Every row is clipped to ‖h‖ ≤ L; one unit (a patient) owns at most m rows (group privacy:
    adding or removing m rows moves a sum by at most m times one row, by the triangle
    inequality). With label clipping at k (``max_positive_labels``; 0 = off, i.e. k = C_r) a row
    positive in p classes enters the positive sums and counts with weight min(1, √(k/p)). One row
    h, labelled (and positive) in all C_r classes of the release, changes

        gram     G = Σ h hᵀ (d x d)            by ‖h hᵀ‖_F = ‖h‖² ≤ L²   →  Δ = m·L²
        s_pos    S+ (d x C_r), w·h per column  by √min(k, C_r)·L          →  Δ = m·√min(k, C_r)·L
        t_sum    T  (d x C_r), h per column    by √C_r·L                  →  Δ = m·√C_r·L
        counts   n+ (w each) and N (1 each)    by √(min(k, C_r) + C_r)    →  Δ = m·√(min(k,C_r)+C_r)

    (k = C_r gives √C_r·L and √(2C_r)). The pseudo kinds of round 2 are the same statistics of the
    pseudo-labelled rows. ``n_classes`` is C_r (ignored for ``gram``).
    """
    if not (clip_norm > 0 and math.isfinite(clip_norm)) or rows_per_individual < 1:
        raise AccountingError("need a finite clip_norm > 0 and rows_per_individual >= 1")
    if max_positive_labels < 0:
        raise AccountingError(f"max_positive_labels must be >= 0, got {max_positive_labels}")
    m = float(rows_per_individual)
    base = base_kind(kind)
    if base == "gram":
        return m * clip_norm**2
    if n_classes < 1:
        raise AccountingError(f"{kind}: need n_classes >= 1, got {n_classes}")
    k = n_classes if max_positive_labels == 0 else min(max_positive_labels, n_classes)
    if base == "s_pos":
        return m * math.sqrt(k) * clip_norm
    if base == "t_sum":
        return m * math.sqrt(n_classes) * clip_norm
    return m * math.sqrt(float(k + n_classes))


def statistic_shape(kind: StatisticKind, *, d: int, n_classes: int) -> tuple[int, int]:
    """Logical shape of a release: gram (d, d), sums (d, C_r), counts (2, C_r)."""
    base = base_kind(kind)
    if base == "gram":
        return (d, d)
    if base == "counts":
        return (2, n_classes)
    return (d, n_classes)


@dataclass(frozen=True)
class BudgetSplit:
    """a_κ: the share of a site's μ² each statistic kind gets (Σ = 1); the pseudo kinds of
    round 2 take their base kind's share."""

    gram: float
    s_pos: float
    t_sum: float
    counts: float

    def __post_init__(self) -> None:
        values = (self.gram, self.s_pos, self.t_sum, self.counts)
        if not all(v > 0 and math.isfinite(v) for v in values):
            raise AccountingError(f"budget shares must be finite and > 0, got {values}")
        if not math.isclose(sum(values), 1.0, rel_tol=1e-9):
            raise AccountingError(f"budget shares must sum to 1, got {sum(values)}")

    def share(self, kind: StatisticKind) -> float:
        return float(getattr(self, base_kind(kind)))


#: One quarter each: σ_r = z·Δ_r for every release (the mechanism before the measured split).
EQUAL_SPLIT = BudgetSplit(0.25, 0.25, 0.25, 0.25)
#: The measured default (docs/benchmarks.md §2): the positive sums dominate the error of the
#: balanced targets (rare classes divide them by a few hundred positives), the feature sums and
#: counts are divided by thousands of rows and need little.
DEFAULT_SPLIT = BudgetSplit(0.2, 0.7, 0.05, 0.05)


@dataclass(frozen=True)
class Mechanism:
    """Everything the sensitivities and the noise split depend on.

    ``clip_norm`` L; ``rows_per_individual`` m (the per-patient cap: 1 image per patient by
    default); ``max_positive_labels`` k (label clipping, 0 = off); ``split`` the budget shares;
    ``joint`` calibrates each release on its members' same-kind releases together (module
    docstring) instead of on itself alone.
    """

    clip_norm: float
    rows_per_individual: int = 1
    max_positive_labels: int = 1
    split: BudgetSplit = DEFAULT_SPLIT
    joint: bool = True

    def sensitivity(self, release: StatisticRelease) -> float:
        """Δ_r of ``release`` (:func:`statistic_sensitivity`)."""
        return statistic_sensitivity(
            release.kind,
            clip_norm=self.clip_norm,
            n_classes=release.n_classes,
            rows_per_individual=self.rows_per_individual,
            max_positive_labels=self.max_positive_labels,
        )

    def rounded_coordinates(self, release: StatisticRelease) -> int:
        """D_r of ``release`` (:func:`rounded_coordinates`)."""
        return rounded_coordinates(
            release.kind,
            shape=release.shape,
            n_classes=release.n_classes,
            max_positive_labels=self.max_positive_labels,
        )


def rounded_coordinates(
    kind: StatisticKind, *, shape: Sequence[int], n_classes: int, max_positive_labels: int
) -> int:
    """D_r, the values of a release rounded to the noise grid: all of them, for counts only the
    weighted positive counts (label clipping; the label counts N are integers)."""
    if base_kind(kind) == "counts":
        return n_classes if max_positive_labels else 0
    return math.prod(shape)


def previous_mechanism(clip_norm: float, *, rows_per_individual: int = 1) -> Mechanism:
    """The mechanism before the measured choices: equal split, per-release calibration, no label
    clipping (kept for the utility comparison of docs/benchmarks.md §2)."""
    return Mechanism(
        clip_norm,
        rows_per_individual=rows_per_individual,
        max_positive_labels=0,
        split=EQUAL_SPLIT,
        joint=False,
    )


def assumed_colluders(*, members: int, tolerated: int, local: bool) -> int:
    """t_r, the members of a release whose noise share is not counted on.

    t_r = min(t, n_r - 1) under secure aggregation (t = ``tolerated`` colluders or drop-outs);
    t_r = n_r - 1 when ``local`` (plaintext: the coordinator sees every upload, so each member
    adds the full σ_r, local DP).
    """
    if members < 1 or tolerated < 0:
        raise AccountingError(f"need members >= 1 and tolerated >= 0 (got {members}, {tolerated})")
    return members - 1 if local else min(tolerated, members - 1)


def noise_share(sigma: float, *, members: int, colluders: int) -> float:
    """σ_s = σ/√(n - t): one member's share of the noise of a release with guaranteed σ.

    Each of the n members adds N(0, σ_s²); any n - t honest members alone sum to variance
    (n - t)·σ_s² = σ². Requires 0 ≤ t < n (AccountingError otherwise).
    """
    if not 0 <= colluders < members:
        raise AccountingError(f"need 0 <= assumed colluders < members (got {colluders}, {members})")
    if not sigma >= 0:
        raise AccountingError(f"sigma must be >= 0, got {sigma}")
    return sigma / math.sqrt(members - colluders)


def protecting_sigma(share_sigma: float, *, members: int, colluders: int, local: bool) -> float:
    """The noise that protects one member's contribution from the adversary that sees it.

    ``local`` (plaintext): the coordinator sees the member's upload alone, protected by the
    member's own share σ_s only. Otherwise (mask, ckks: the coordinator and up to t colluding or
    excluded members see the sum) the n - t honest shares protect it: σ_s·√(n - t).
    """
    if not 0 <= colluders < members:
        raise AccountingError(f"need 0 <= assumed colluders < members (got {colluders}, {members})")
    if not share_sigma >= 0:
        raise AccountingError(f"share sigma must be >= 0, got {share_sigma}")
    return share_sigma if local else share_sigma * math.sqrt(members - colluders)


def grid_frac_bits(*, sensitivity: float, coordinates: int, share_sigma: float) -> int:
    """Fractional bits f of the noise grid 2^-f of one release: the smallest f ≥ 0 with

        √D·2^-f ≤ 1e-4·Δ      (rounding D values to the grid inflates Δ by at most 1e-4·Δ)
        σ_s·2^f ≥ 64          (the share's discrete Gaussian spans at least 64 grid steps)

    i.e. f = max(0, ⌈log2 max(√D / (1e-4·Δ), 64/σ_s)⌉); D = 0 (integer values) drops the first
    condition. The caller bounds f (the integer range of the transport).
    """
    if not sensitivity > 0 or not share_sigma > 0 or coordinates < 0:
        raise AccountingError("need sensitivity > 0, share_sigma > 0 and coordinates >= 0")
    need = MIN_SHARE_STEPS / share_sigma
    if coordinates:
        need = max(need, math.sqrt(coordinates) / (GRID_INFLATION_MAX * sensitivity))
    return max(0, math.ceil(math.log2(need)))


def grid_inflation(*, coordinates: int, frac_bits: int) -> float:
    """√D·2^-f: how far rounding D values to the grid 2^-f can move them in L2 (each by < 2^-f).

    The accounted sensitivity of a release on the grid is Δ + √D·2^-f.
    """
    if coordinates < 0 or frac_bits < 0:
        raise AccountingError("need coordinates >= 0 and frac_bits >= 0")
    return math.sqrt(coordinates) * 2.0**-frac_bits


def noise_multiplier_for_sites(
    *, epsilon: float, delta: float, releases_per_site: Iterable[float]
) -> float:
    """One noise multiplier z with every site (ε_k ≤ ε, δ)-DP, for sites whose μ_k² is
    c_k/z² (``releases_per_site``: the c_k; R_k for R_k releases with σ_r = z·Δ_r).

    The worst site has c = max_k c_k and z = √c · z*(ε, δ), z* the multiplier of one release
    (:func:`calibrate_noise_multiplier`, μ* = 1/z*). ε = inf gives 0 (no noise).
    """
    worst = max(releases_per_site, default=0)
    if not worst > 0:
        raise AccountingError("the plan releases nothing to calibrate")
    return calibrate_noise_multiplier(epsilon=epsilon, delta=delta) * math.sqrt(worst)


def compose_mu(mus: Iterable[float]) -> float:
    """μ of the adaptive composition of μ_i-GDP mechanisms: √(Σ μ_i²) (inf if any is)."""
    total = 0.0
    for mu in mus:
        if not mu >= 0:
            raise AccountingError(f"mu must be >= 0, got {mu}")
        if math.isinf(mu):
            return math.inf
        total += mu * mu
    return math.sqrt(total)


@dataclass(frozen=True)
class ReleaseGroup:
    """Classes that share one contributing member set: they are released together."""

    members: tuple[str, ...]
    classes: tuple[str, ...]


def release_groups(
    *,
    classes: Sequence[str],
    participants: Collection[str],
    coverage: Mapping[str, Collection[str]],
    gram_scope: str,
) -> tuple[ReleaseGroup, ...]:
    """The release groups of a DP round (``coverage`` maps site -> the classes it labels).

    ``global``: one group, every participant (sorted), every class. ``per-class``: one group per
    distinct coverage set S_c = {k : c ∈ coverage[k]} (sorted), its classes in ``classes``
    order, groups in order of first class; a class no participant labels is in no group.
    """
    if gram_scope not in GRAM_SCOPES:
        raise AccountingError(f"gram_scope must be one of {GRAM_SCOPES}, got {gram_scope!r}")
    everyone = tuple(sorted(participants))
    groups: dict[tuple[str, ...], list[str]] = {}
    for c in classes:
        members = (
            everyone
            if gram_scope == "global"
            else tuple(s for s in everyone if c in coverage.get(s, ()))
        )
        if members:
            groups.setdefault(members, []).append(c)
    return tuple(ReleaseGroup(m, tuple(cls)) for m, cls in groups.items())


@dataclass(frozen=True)
class StatisticRelease:
    """One released statistic as plain data: ``name`` is its key, ``n_classes`` its C_r."""

    name: str
    kind: StatisticKind
    members: tuple[str, ...]
    n_classes: int
    shape: tuple[int, ...]


def plan_releases(groups: Sequence[ReleaseGroup], *, d: int) -> list[StatisticRelease]:
    """The four releases (:data:`STATISTIC_KINDS`) of every group, named ``kind[classes]``."""
    out = []
    for g in groups:
        c_r = len(g.classes)
        for kind in STATISTIC_KINDS:
            name = f"{kind}[{','.join(g.classes)}]"
            shape = statistic_shape(kind, d=d, n_classes=c_r)
            out.append(StatisticRelease(name, kind, g.members, c_r, shape))
    return out


def global_gram_release(participants: Collection[str], *, d: int) -> StatisticRelease:
    """``gram[all]`` over every participant: round 2 of a two-round run solves with it, so a
    ``per-class`` round 1 whose groups have no Gram over everyone releases it too."""
    return StatisticRelease("gram[all]", "gram", tuple(sorted(participants)), 0, (d, d))


def pseudo_releases(
    participants: Collection[str], *, classes: Sequence[str], d: int
) -> list[StatisticRelease]:
    """Round 2's releases: the three pseudo-label statistics (:data:`PSEUDO_KINDS`) over every
    participant and class (a site sends zeros for the classes it labels itself)."""
    members = tuple(sorted(participants))
    c = len(classes)
    return [
        StatisticRelease(kind, kind, members, c, statistic_shape(kind, d=d, n_classes=c))
        for kind in PSEUDO_KINDS
    ]


@dataclass(frozen=True)
class ReleaseNoise:
    """Noise of one release: guaranteed σ, accounted sensitivity, grid, colluders assumed."""

    sigma: float
    sensitivity: float
    frac_bits: int
    assumed_colluders: int


@dataclass(frozen=True)
class NoiseCalibration:
    """The calibrated noise of every release (by name) and the ε each site spends."""

    noise_multiplier: float
    noise: Mapping[str, ReleaseNoise]
    site_epsilon: Mapping[str, float]


def site_epsilons(
    releases: Sequence[StatisticRelease],
    noise: Mapping[str, ReleaseNoise],
    *,
    sites: Iterable[str],
    delta: float,
    earlier: Sequence[tuple[StatisticRelease, ReleaseNoise]] = (),
) -> dict[str, float]:
    """ε_k at δ of every site: the composition (:func:`epsilon_for_releases`) of the releases it
    is a member of, μ_k² = Σ_{r ∋ k} (Δ_r/σ_r)² with the accounted Δ_r and σ_r of ``noise``,
    and of the ``earlier`` releases of the same run (round 1 for round 2) it was a member of."""
    out = {}
    for site in sites:
        mine = [
            GaussianRelease(r.name, noise[r.name].sensitivity, noise[r.name].sigma)
            for r in releases
            if site in r.members
        ]
        mine += [
            GaussianRelease(r.name, n.sensitivity, n.sigma) for r, n in earlier if site in r.members
        ]
        out[site] = epsilon_for_releases(mine, delta=delta)
    return out


def _calibration_sensitivities(
    releases: Sequence[StatisticRelease], mechanism: Mechanism
) -> dict[str, float]:
    """Δ̂_r (module docstring): Δ_r, or with ``joint`` the largest over r's members of the L2
    composition of that member's releases of r's kind."""
    sens = {r.name: mechanism.sensitivity(r) for r in releases}
    if not mechanism.joint:
        return sens
    per_site: dict[tuple[str, str], float] = {}
    for r in releases:
        for s in r.members:
            per_site[(s, r.kind)] = per_site.get((s, r.kind), 0.0) + sens[r.name] ** 2
    return {r.name: math.sqrt(max(per_site[(s, r.kind)] for s in r.members)) for r in releases}


def calibrate_releases(
    releases: Sequence[StatisticRelease],
    *,
    epsilon: float,
    delta: float,
    mechanism: Mechanism,
    tolerated: int = 0,
    local: bool = False,
    participants: Collection[str] | None = None,
    reserved: Sequence[StatisticRelease] = (),
    noise_multiplier: float | None = None,
    earlier: Sequence[tuple[StatisticRelease, ReleaseNoise]] = (),
) -> NoiseCalibration:
    """Noise of every release so that every site is (ε_k ≤ ε, δ)-DP over its run (finite ε > 0).

    For release r of kind κ with n_r members: Δ_r and Δ̂_r (:func:`_calibration_sensitivities`
    over ``releases`` and the ``reserved`` releases of the run's later round), t_r
    (:func:`assumed_colluders`), σ_r = z·Δ̂_r/√a_κ, its grid f_r (:func:`grid_frac_bits` for the
    share σ_r/√(n_r - t_r)), the accounted sensitivity Δ'_r = Δ_r + √D_r·2^-f_r
    (:func:`grid_inflation`) and σ_r scaled by the same factor. z makes the worst site's
    Σ_{r ∋ k} a_κ·(Δ_r/Δ̂_r)² (over ``releases`` and ``reserved``) cost exactly (ε, δ)
    (:func:`noise_multiplier_for_sites`), unless ``noise_multiplier`` fixes it (round 2 keeps
    round 1's z). ε_k by :func:`site_epsilons` over ``participants`` (default: every member),
    composed with the run's ``earlier`` releases.
    """
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise AccountingError(f"epsilon must be finite and > 0, got {epsilon}")
    sites = (
        sorted({s for r in releases for s in r.members})
        if participants is None
        else list(participants)
    )
    every = [*releases, *reserved]
    calib = _calibration_sensitivities(every, mechanism)
    base = {r.name: mechanism.sensitivity(r) for r in every}
    if noise_multiplier is None:
        cost = [
            sum(
                mechanism.split.share(r.kind) * (base[r.name] / calib[r.name]) ** 2
                for r in every
                if s in r.members
            )
            for s in sites
        ]
        z = noise_multiplier_for_sites(epsilon=epsilon, delta=delta, releases_per_site=cost)
    else:
        if not noise_multiplier > 0:
            raise AccountingError(f"noise_multiplier must be > 0, got {noise_multiplier}")
        z = noise_multiplier
    noise: dict[str, ReleaseNoise] = {}
    for r in releases:
        n_r = len(r.members)
        t_r = assumed_colluders(members=n_r, tolerated=tolerated, local=local)
        sigma = z * calib[r.name] / math.sqrt(mechanism.split.share(r.kind))
        share = noise_share(sigma, members=n_r, colluders=t_r)
        coords = mechanism.rounded_coordinates(r)
        frac = grid_frac_bits(sensitivity=base[r.name], coordinates=coords, share_sigma=share)
        sens = base[r.name] + grid_inflation(coordinates=coords, frac_bits=frac)
        noise[r.name] = ReleaseNoise(sigma * sens / base[r.name], sens, frac, t_r)
    eps = site_epsilons(releases, noise, sites=sites, delta=delta, earlier=earlier)
    return NoiseCalibration(z, noise, eps)


def site_colluders(*, members: int, stated: int, fraction: float) -> int:
    """t'_r = min(n_r - 1, max(t_r, ⌈fraction·n_r⌉)): the colluders a site assumes among the
    n_r members of a release, its own floor (a ``fraction`` of the members, ⌈n/3⌉ by default at
    the site, docs/protocol.md §7) or the plan's t_r, whichever is larger. ``fraction·n`` is
    rounded to 9 decimals before the ceiling (0.3·10 is 3.0000000000000004 in binary64)."""
    if members < 1 or stated < 0:
        raise AccountingError(f"need members >= 1 and stated >= 0 (got {members}, {stated})")
    if not 0.0 <= fraction < 1.0:
        raise AccountingError(f"a colluder fraction lies in [0, 1), got {fraction!r}")
    return min(members - 1, max(stated, math.ceil(round(fraction * members, 9))))


def site_view_releases(
    releases: Sequence[tuple[str, float, float, int, int]],
    *,
    local: bool,
    colluder_fraction: float = 0.0,
) -> list[GaussianRelease]:
    """A site's own accounting of the releases it contributes to, under the view of the
    adversary that sees its upload (:func:`protecting_sigma`).

    ``releases``: (name, sensitivity Δ_r, guaranteed σ_r, members n_r, assumed colluders t_r)
    as the plan states them; the site adds the share σ_s = σ_r/√(n_r - t_r) itself. Under
    secure aggregation the site does not take t_r on trust: it assumes
    t'_r = :func:`site_colluders` (its own ``colluder_fraction`` of the members, or t_r if
    larger), so the shares that protect it are n_r - t'_r and the protecting σ is
    σ_s·√(n_r - t'_r) ≤ σ_r. Returns one :class:`GaussianRelease` per release with the
    protecting σ (compose with :func:`mu_from_releases` or :func:`epsilon_for_releases`).
    """
    out = []
    for name, sensitivity, sigma, members, colluders in releases:
        share = noise_share(sigma, members=members, colluders=colluders)
        assumed = (
            colluders
            if local
            else site_colluders(members=members, stated=colluders, fraction=colluder_fraction)
        )
        protect = protecting_sigma(share, members=members, colluders=assumed, local=local)
        out.append(GaussianRelease(name, sensitivity, protect))
    return out
