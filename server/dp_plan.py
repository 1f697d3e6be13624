"""DP mode of a round: the releases, noise calibration and per-site budgets (docs/protocol.md §7).

Configured by an optional ``[round.dp]`` table of server.toml (:class:`DpSettings`)::

    [round.dp]
    epsilon = 2.0              # per site, per round (composition of every release it is in)
    delta = 1e-5
    clip_norm = 1.0            # L: every feature row is clipped to ||h|| <= L by its site
    tolerated = 0              # t: colluding or dropping contributors the noise split tolerates
    rows_per_individual = 1    # m: images per patient (group privacy multiplies sensitivities)

Every formula is the rulebook's (:mod:`afl.core.dp_accounting`); this module maps it onto the
plan's protobuf releases. Releases (round 1 only): instead of balanced b (its scale 1/N+ is data
dependent), sites release the ADDITIVE statistics over each group of classes that share one
contributing set (:func:`~afl.core.dp_accounting.release_groups`: one group over all
participants in ``global`` scope; one per distinct coverage set S_c in ``per-class`` scope):
``gram`` (packed Gram, Δ = m·L² Frobenius), ``s_pos`` (S+ per class, d x C_r, Δ = m·√C_r·L),
``t_sum`` (T per class, d x C_r, Δ = m·√C_r·L) and ``counts`` (n+ and N per class, 2 x C_r,
Δ = m·√(2C_r)).

Noise (:func:`~afl.core.dp_accounting.calibrate_releases`): each release r carries a discrete
Gaussian on the grid 2^-f_r (``DpNoise.frac_bits``). Rounding a site's values to the grid moves
each of the D_r coordinates by < 1 grid step, so the sensitivity used for accounting is
Δ_r + √D_r·2^-f_r (counts are integers: no inflation); f_r is chosen so that this inflation is
≤ 1e-4·Δ_r and a share spans ≥ 64 grid steps, and a plan needing f_r > 40 is refused (epsilon too
large for the integer grid). One noise multiplier z is used for every release: σ_r = z·Δ_r.
Site k's releases compose into μ_k-GDP with μ_k = √R_k / z (R_k = releases site k is a member
of), so z = z*(ε, δ)·√max_k R_k makes every site (ε_k ≤ ε, δ)-DP; ε_k is the composition of its
releases (opacus' exact GDP dual).

Distributed noise: ``DpNoise.sigma`` is the GUARANTEED standard deviation σ_r in the released sum;
each of the n_r members adds a share N_Z(0, σ_r²/(n_r - t_r)) (``assumed_colluders`` t_r), so the
shares of any n_r - t_r honest members alone have variance ≥ σ_r². In MASK/CKKS mode
t_r = min(t, n_r - 1). In PLAINTEXT mode the server sees every upload, so it is a colluder with
everyone else: t_r = n_r - 1 and every site adds the full σ_r (local DP), whatever ``tolerated``
says. The sum of the honest discrete Gaussian shares is accounted as one Gaussian of σ_r, an
approximation we state rather than hide: a sum of discrete Gaussians is close to a discrete
Gaussian, with a slack that decays like e^{-cσ_s²} in the share's σ_s in grid units (Kairouz, Liu
& Steinke 2021, "The Distributed Discrete Gaussian Mechanism"), so shares are kept at ≥ 64 grid
steps; and the discrete Gaussian's privacy matches the continuous one's at the same σ up to
terms of the same kind (Canonne, Kamath & Steinke 2020). Sampling itself is exact up to binary64
rounding (:mod:`afl.crypto.dgauss`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from afl.core.dp_accounting import (
    ReleaseNoise,
    StatisticKind,
    StatisticRelease,
    calibrate_releases,
    noise_share,
    plan_releases,
    release_groups,
)
from afl.core.leakage import LeakageReport, Release, audit_releases
from afl.proto.v1 import common_pb2
from afl.server.plan import GLOBAL_GRAM, PlannedRelease

__all__ = [
    "DpCalibration",
    "DpSettings",
    "ReleaseNoise",
    "apply_dp",
    "audit_dp_plan",
    "calibrate",
    "dp_releases",
    "dp_settings_from_table",
]

_KINDS: dict[StatisticKind, int] = {
    "gram": common_pb2.STATISTIC_KIND_GRAM,
    "s_pos": common_pb2.STATISTIC_KIND_POSITIVE_SUM,
    "t_sum": common_pb2.STATISTIC_KIND_FEATURE_SUM,
    "counts": common_pb2.STATISTIC_KIND_COUNT,
}
_PREFIX: dict[int, StatisticKind] = {int(v): k for k, v in _KINDS.items()}
_DP_KEYS = {"epsilon", "delta", "clip_norm", "tolerated", "rows_per_individual"}
_MAX_FRAC_BITS = 40  # the integer grid's range on the wire (afl.client.dp_payloads)


@dataclass(frozen=True)
class DpSettings:
    """The validated ``[round.dp]`` table (module docstring)."""

    epsilon: float
    delta: float
    clip_norm: float
    tolerated: int = 0
    rows_per_individual: int = 1

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"epsilon must be finite and > 0, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must lie in (0, 1), got {self.delta}")
        if not (self.clip_norm > 0 and math.isfinite(self.clip_norm)):
            raise ValueError(f"clip_norm must be finite and > 0, got {self.clip_norm}")
        if self.tolerated < 0 or self.rows_per_individual < 1:
            raise ValueError("need tolerated >= 0 and rows_per_individual >= 1")


def dp_settings_from_table(table: Mapping[str, Any]) -> DpSettings:
    """:class:`DpSettings` from a ``[round.dp]`` TOML table; ValueError names the bad key."""
    unknown = sorted(set(table) - _DP_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; known: {sorted(_DP_KEYS)}")
    for key in ("epsilon", "clip_norm"):
        if key not in table:
            raise ValueError(f"{key} is required")
    values: dict[str, Any] = {}
    for key, value in table.items():
        want_int = key in ("tolerated", "rows_per_individual")
        ok = isinstance(value, int) if want_int else isinstance(value, int | float)
        if isinstance(value, bool) or not ok:
            raise ValueError(f"{key} must be {'an integer' if want_int else 'a number'}")
        values[key] = value if want_int else float(value)
    values.setdefault("delta", 1e-5)
    return DpSettings(**values)


def _group_label(members: Sequence[str], everyone: Sequence[str]) -> str:
    return "[all]" if list(members) == list(everyone) else "{" + ",".join(members) + "}"


def dp_releases(
    *,
    classes: Sequence[str],
    participants: Sequence[str],
    coverage: Mapping[str, Collection[str]],
    gram_scope: str,
    d: int,
) -> list[PlannedRelease]:
    """Round-1 releases of DP mode (module docstring); ``coverage`` maps site -> classes.

    The groups and their four statistics are :func:`afl.core.dp_accounting.release_groups` and
    :func:`~afl.core.dp_accounting.plan_releases`; only the release names are chosen here.
    """
    everyone = sorted(participants)
    groups = release_groups(
        classes=classes, participants=everyone, coverage=coverage, gram_scope=gram_scope
    )
    out: list[PlannedRelease] = []
    for group in groups:
        members = group.members
        gram_name = GLOBAL_GRAM if list(members) == everyone else "gram" + _group_label(members, [])
        suffix = "" if gram_scope == "global" else "[" + ",".join(group.classes) + "]"
        for r in plan_releases([group], d=d):
            name = gram_name if r.kind == "gram" else f"{r.kind}{suffix}"
            class_names = () if r.kind == "gram" else group.classes
            out.append(PlannedRelease(name, members, _KINDS[r.kind], class_names, r.shape))
    return out


def audit_dp_plan(releases: Sequence[PlannedRelease], participants: Sequence[str]) -> LeakageReport:
    """Design §5 row-space audit of a DP plan (one quantity per statistic and class column)."""
    rows = []
    for r in releases:
        if r.kind == _KINDS["gram"]:
            rows.append(Release(r.name, frozenset(r.members), "gram"))
            continue
        for c in r.class_names:
            rows.append(
                Release(f"{r.name}#{c}", frozenset(r.members), f"{_PREFIX[int(r.kind)]}[{c}]")
            )
    return audit_releases(rows, sorted(participants), min_cohort=min(3, max(1, len(participants))))


@dataclass(frozen=True)
class DpCalibration:
    """Noise per release and the (ε, δ) each site spends in the round."""

    settings: DpSettings
    noise: Mapping[str, ReleaseNoise]
    site_epsilon: Mapping[str, float]
    noise_multiplier: float

    def to_audit(self) -> dict[str, object]:
        """The audit-log entry (no statistics): ε, δ per site and σ per release."""
        return {
            "epsilon_target": self.settings.epsilon,
            "delta": self.settings.delta,
            "clip_norm": self.settings.clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "sites": {
                s: {"epsilon": e, "delta": self.settings.delta}
                for s, e in sorted(self.site_epsilon.items())
            },
            "releases": {
                n: {
                    "sigma": v.sigma,
                    "sensitivity": v.sensitivity,
                    "assumed_colluders": v.assumed_colluders,
                }
                for n, v in sorted(self.noise.items())
            },
        }


def _statistic(release: PlannedRelease) -> StatisticRelease:
    """A planned release as the rulebook's plain data."""
    kind = _PREFIX.get(int(release.kind))
    if kind is None:
        raise ValueError(f"release {release.name}: kind {release.kind} is not a DP statistic")
    return StatisticRelease(
        release.name, kind, tuple(release.members), len(release.class_names), release.shape
    )


def calibrate(
    releases: Sequence[PlannedRelease],
    settings: DpSettings,
    *,
    participants: Sequence[str],
    plaintext: bool,
) -> DpCalibration:
    """σ per release and ε per site (:func:`afl.core.dp_accounting.calibrate_releases`;
    ``plaintext``: local DP, t_r = n_r - 1). ValueError (an
    :class:`~afl.core.dp_accounting.AccountingError` from the rulebook) when the plan releases
    nothing or its grid would need more than 40 fractional bits."""
    cal = calibrate_releases(
        [_statistic(r) for r in releases],
        epsilon=settings.epsilon,
        delta=settings.delta,
        clip_norm=settings.clip_norm,
        rows_per_individual=settings.rows_per_individual,
        tolerated=settings.tolerated,
        local=plaintext,
        participants=participants,
    )
    for r in releases:
        n = cal.noise[r.name]
        if n.frac_bits > _MAX_FRAC_BITS:
            share = noise_share(n.sigma, members=len(r.members), colluders=n.assumed_colluders)
            raise ValueError(
                f"release {r.name}: noise share {share:.3g} is too small for the integer grid "
                f"(epsilon {settings.epsilon:g} is too large; use a smaller epsilon)"
            )
    return DpCalibration(settings, cal.noise, cal.site_epsilon, cal.noise_multiplier)


def apply_dp(plan: common_pb2.ReleasePlan, calibration: DpCalibration) -> None:
    """Write the noise of every release, the DP parameters and the site budgets into ``plan``."""
    s = calibration.settings
    plan.dp.CopyFrom(
        common_pb2.DpParams(enabled=True, clip_norm=s.clip_norm, delta=s.delta, epsilon=s.epsilon)
    )
    for release in plan.releases:
        n = calibration.noise[release.name]
        release.noise.CopyFrom(
            common_pb2.DpNoise(
                mechanism=common_pb2.NOISE_MECHANISM_DISCRETE_GAUSSIAN,
                sigma=n.sigma,
                sensitivity=n.sensitivity,
                assumed_colluders=n.assumed_colluders,
                frac_bits=n.frac_bits,
            )
        )
    del plan.budgets[:]
    plan.budgets.extend(
        common_pb2.SiteBudget(site_id=site, epsilon=eps, delta=s.delta)
        for site, eps in sorted(calibration.site_epsilon.items())
    )
