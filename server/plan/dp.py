"""DP mode of a run: the releases, noise calibration and per-site budgets (docs/protocol.md §7).

Configured by an optional ``[round.dp]`` table of server.toml (:class:`DpSettings`)::

    [round.dp]
    epsilon = 2.0              # per site, per run (every release of round 1 and round 2)
    delta = 1e-5
    clip_norm = 1.0            # L: every feature row is clipped to ||h|| <= L by its site
    tolerated = 0              # t: colluding or dropping contributors the noise split tolerates
    unit = "patient"           # or "image": the unit of privacy
    images_per_patient = 1     # m: the most images a site keeps per patient (unit = "patient")
    max_positive_labels = 1    # k: label clipping (0 = off)
    max_samples = 0            # N, the largest site's rows: bounds the mask/ckks encodings
    eval_epsilon = 0.0         # per site, the evaluation round's ε (0: the run cannot evaluate)

Every formula is the rulebook's (:mod:`afl.core.dp.accounting`); this module maps it onto the
plan's protobuf releases. Round 1: instead of balanced b (its scale 1/N+ is data dependent),
sites release the ADDITIVE statistics over each group of classes that share one contributing set
(:func:`~afl.core.dp.accounting.release_groups`: one group over all participants in ``global``
scope; one per distinct coverage set S_c in ``per-class`` scope): ``gram`` (packed Gram),
``s_pos`` (S+ per class, d x C_r), ``t_sum`` (T per class, d x C_r) and ``counts`` (n+ and N per
class, 2 x C_r), with the sensitivities of
:func:`~afl.core.dp.accounting.statistic_sensitivity` for the unit (m images per patient) and
label clipping (k). Round 2 of a two-round run releases ``pseudo_s_pos``, ``pseudo_t_sum`` and
``pseudo_counts`` over every participant (the same statistics of the rows each site
pseudo-labels with the round-1 model); its solve reuses round 1's ``gram[all]`` (planned in
round 1 when no per-class group covers everyone) and round 1's targets.

Noise (:func:`~afl.core.dp.accounting.calibrate_releases`): release r of kind κ carries a
discrete Gaussian of σ_r = z·Δ̂_r/√a_κ (the measured budget split a, joint calibration of a site's
same-kind releases) on the grid 2^-f_r (``DpNoise.frac_bits``). Rounding a site's values to the
grid moves each of the D_r coordinates by < 1 grid step, so the sensitivity used for accounting
is Δ_r + √D_r·2^-f_r; f_r is chosen so that this inflation is ≤ 1e-4·Δ_r and a share spans ≥ 64
grid steps, and a plan needing f_r > 40 is refused (epsilon too large for the integer grid). z is
chosen in round 1 for the whole run: with ``rounds = 2`` the round-2 releases are reserved, so
every site is (ε_k ≤ ε, δ)-DP over both rounds; round 2 keeps round 1's z (``DpParams.noise_
multiplier``) and its budgets state the run's composed ε (``SiteBudget.epsilon_run``).

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
from dataclasses import dataclass, field, replace
from typing import Any

from afl.core.dp.accounting import (
    DEFAULT_SPLIT,
    Mechanism,
    ReleaseNoise,
    StatisticKind,
    StatisticRelease,
    calibrate_noise_multiplier,
    calibrate_releases,
    global_gram_release,
    noise_share,
    plan_releases,
    pseudo_releases,
    release_groups,
    site_epsilons,
)
from afl.core.dp.evaluation import evaluation_noise
from afl.core.leakage import LeakageReport, Release, audit_releases
from afl.proto.v1 import common_pb2
from afl.proto.wire import DP_STATISTIC_NAMES
from afl.server.plan.release import GLOBAL_GRAM, PlannedRelease

__all__ = [
    "DP_KINDS",
    "DpCalibration",
    "DpSettings",
    "ReleaseNoise",
    "apply_dp",
    "audit_dp_plan",
    "calibrate",
    "calibrate_evaluation",
    "dp_releases",
    "dp_settings_from_table",
    "plan_noise",
]

#: The rulebook's statistic kinds and the plan's StatisticKind values.
_PREFIX: dict[int, StatisticKind] = dict(DP_STATISTIC_NAMES)
DP_KINDS: dict[StatisticKind, int] = {k: v for v, k in DP_STATISTIC_NAMES.items()}
_INT_KEYS = ("tolerated", "images_per_patient", "max_positive_labels", "max_samples")
_DP_KEYS = {"epsilon", "delta", "clip_norm", "unit", "eval_epsilon", *_INT_KEYS}
_UNITS = {"patient": common_pb2.PRIVACY_UNIT_PATIENT, "image": common_pb2.PRIVACY_UNIT_IMAGE}
_MAX_FRAC_BITS = 40  # the integer grid's range on the wire (afl.client.payloads.dp)


@dataclass(frozen=True)
class DpSettings:
    """The validated ``[round.dp]`` table (module docstring)."""

    epsilon: float
    delta: float
    clip_norm: float
    tolerated: int = 0
    unit: str = "patient"
    images_per_patient: int = 1
    max_positive_labels: int = 1
    max_samples: int = 0
    eval_epsilon: float = 0.0

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"epsilon must be finite and > 0, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must lie in (0, 1), got {self.delta}")
        if not (self.clip_norm > 0 and math.isfinite(self.clip_norm)):
            raise ValueError(f"clip_norm must be finite and > 0, got {self.clip_norm}")
        if self.unit not in _UNITS:
            raise ValueError(f"unit must be one of {sorted(_UNITS)}, got {self.unit!r}")
        if self.unit == "image" and self.images_per_patient != 1:
            raise ValueError("images_per_patient applies to unit = 'patient' only")
        if min(self.tolerated, self.max_positive_labels, self.max_samples) < 0:
            raise ValueError("tolerated, max_positive_labels and max_samples must be >= 0")
        if self.images_per_patient < 1:
            raise ValueError("images_per_patient must be >= 1")
        if not (self.eval_epsilon >= 0 and math.isfinite(self.eval_epsilon)):
            raise ValueError(f"eval_epsilon must be finite and >= 0, got {self.eval_epsilon}")

    @property
    def mechanism(self) -> Mechanism:
        """The rulebook's mechanism of these settings (the measured budget split)."""
        return Mechanism(
            self.clip_norm,
            rows_per_individual=self.images_per_patient,
            max_positive_labels=self.max_positive_labels,
            split=DEFAULT_SPLIT,
        )

    @property
    def guarantee(self) -> str:
        """``patient-level (ε, δ)`` or ``image-level (ε, δ)``: what the budgets mean."""
        return f"{self.unit}-level (ε, δ)"


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
        if key == "unit":
            if not isinstance(value, str):
                raise ValueError("unit must be a string ('patient' or 'image')")
            values[key] = value
            continue
        want_int = key in _INT_KEYS
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
    round_number: int = 1,
    need_global_gram: bool = False,
) -> list[PlannedRelease]:
    """The releases of a DP round (module docstring); ``coverage`` maps site -> classes.

    Round 1: the groups and their four statistics
    (:func:`afl.core.dp.accounting.release_groups`, :func:`~afl.core.dp.accounting.plan_releases`),
    plus ``gram[all]`` when ``need_global_gram`` and no group covers everyone. Round 2: the
    pseudo-label statistics (:func:`~afl.core.dp.accounting.pseudo_releases`).
    """
    everyone = sorted(participants)
    if round_number == 2:
        return [
            PlannedRelease(r.name, r.members, DP_KINDS[r.kind], tuple(classes), r.shape)
            for r in pseudo_releases(everyone, classes=classes, d=d)
        ]
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
            out.append(PlannedRelease(name, members, DP_KINDS[r.kind], class_names, r.shape))
    if need_global_gram and all(r.name != GLOBAL_GRAM for r in out):
        g = global_gram_release(everyone, d=d)
        out.insert(0, PlannedRelease(GLOBAL_GRAM, g.members, DP_KINDS["gram"], (), g.shape))
    return out


def audit_dp_plan(releases: Sequence[PlannedRelease], participants: Sequence[str]) -> LeakageReport:
    """Design §5 row-space audit of a DP plan (one quantity per statistic and class column)."""
    rows = []
    for r in releases:
        if r.kind == DP_KINDS["gram"]:
            rows.append(Release(r.name, frozenset(r.members), "gram"))
            continue
        for c in r.class_names:
            rows.append(
                Release(f"{r.name}#{c}", frozenset(r.members), f"{_PREFIX[int(r.kind)]}[{c}]")
            )
    return audit_releases(rows, sorted(participants), min_cohort=min(3, max(1, len(participants))))


@dataclass(frozen=True)
class DpCalibration:
    """Noise per release and the (ε, δ) each site spends in the round and in its run so far."""

    settings: DpSettings
    noise: Mapping[str, ReleaseNoise]
    site_epsilon: Mapping[str, float]
    noise_multiplier: float
    run_rounds: int = 1
    site_epsilon_run: Mapping[str, float] = field(default_factory=dict)

    def run_epsilon(self, site: str) -> float:
        """ε of ``site`` over its run so far (this round composed with the earlier ones)."""
        return self.site_epsilon_run.get(site, self.site_epsilon[site])

    def to_audit(self) -> dict[str, object]:
        """The audit-log entry (no statistics): ε, δ per site and σ per release."""
        s = self.settings
        return {
            "guarantee": s.guarantee,
            "unit": s.unit,
            "images_per_patient": s.images_per_patient,
            "max_positive_labels": s.max_positive_labels,
            "epsilon_target": s.epsilon,
            "delta": s.delta,
            "clip_norm": s.clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "run_rounds": self.run_rounds,
            "sites": {
                site: {"epsilon": e, "epsilon_run": self.run_epsilon(site), "delta": s.delta}
                for site, e in sorted(self.site_epsilon.items())
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


def plan_noise(
    plan: common_pb2.ReleasePlan,
) -> tuple[float, list[tuple[StatisticRelease, ReleaseNoise]]]:
    """The noise multiplier z and every release with its noise, of a signed DP plan (round 2
    keeps round 1's z and composes with round 1's releases)."""
    out = []
    for r in plan.releases:
        kind = _PREFIX.get(int(r.kind))
        if kind is None:
            raise ValueError(f"release {r.name}: kind {r.kind} is not a DP statistic")
        stat = StatisticRelease(
            r.name, kind, tuple(r.member_site_ids), len(r.class_names), tuple(r.shape)
        )
        noise = ReleaseNoise(
            float(r.noise.sigma),
            float(r.noise.sensitivity),
            int(r.noise.frac_bits),
            int(r.noise.assumed_colluders),
        )
        out.append((stat, noise))
    return float(plan.dp.noise_multiplier), out


def calibrate(
    releases: Sequence[PlannedRelease],
    settings: DpSettings,
    *,
    participants: Sequence[str],
    plaintext: bool,
    run_rounds: int = 1,
    classes: Sequence[str] = (),
    parent: common_pb2.ReleasePlan | None = None,
) -> DpCalibration:
    """σ per release and ε per site (:func:`afl.core.dp.accounting.calibrate_releases`;
    ``plaintext``: local DP, t_r = n_r - 1).

    Round 1 of a run of ``run_rounds`` = 2 reserves round 2's releases over ``participants``
    and ``classes``; round 2 passes its ``parent`` plan (round 1's z, and round 1's releases
    for the composed ε). ValueError (an :class:`~afl.core.dp.accounting.AccountingError` from
    the rulebook) when the plan releases nothing or its grid would need more than 40 fractional
    bits.
    """
    d = next((r.shape[0] for r in releases), 0)
    reserved: list[StatisticRelease] = []
    if parent is None and run_rounds == 2:
        reserved = pseudo_releases(participants, classes=classes, d=d)
    z_fixed, earlier = (None, []) if parent is None else plan_noise(parent)
    cal = calibrate_releases(
        [_statistic(r) for r in releases],
        epsilon=settings.epsilon,
        delta=settings.delta,
        mechanism=settings.mechanism,
        tolerated=settings.tolerated,
        local=plaintext,
        participants=participants,
        reserved=reserved,
        noise_multiplier=z_fixed,
        earlier=earlier,
    )
    for r in releases:
        n = cal.noise[r.name]
        if n.frac_bits > _MAX_FRAC_BITS:
            share = noise_share(n.sigma, members=len(r.members), colluders=n.assumed_colluders)
            raise ValueError(
                f"release {r.name}: noise share {share:.3g} is too small for the integer grid "
                f"(epsilon {settings.epsilon:g} is too large; use a smaller epsilon)"
            )
    alone = cal.site_epsilon
    if parent is not None:  # cal composes with round 1; this round alone:
        stats = [_statistic(r) for r in releases]
        alone = site_epsilons(stats, cal.noise, sites=participants, delta=settings.delta)
    return DpCalibration(
        settings,
        cal.noise,
        alone,
        cal.noise_multiplier,
        run_rounds=run_rounds,
        site_epsilon_run=cal.site_epsilon,
    )


def calibrate_evaluation(
    releases: Sequence[PlannedRelease],
    settings: DpSettings,
    *,
    participants: Sequence[str],
    plaintext: bool,
    earlier: Sequence[common_pb2.ReleasePlan] = (),
) -> DpCalibration:
    """σ of an evaluation round's releases (``eval_hist``, ``eval_confusion``) and each
    member's ε = ``eval_epsilon`` over the round (:func:`afl.core.dp.evaluation.evaluation_noise`:
    Δ = m·√C, the split of :data:`~afl.core.dp.evaluation.EVALUATION_SPLIT`, t_r as the training
    releases'); the calibration's ``epsilon`` is the evaluation's; each site's ε over its run
    composes it with the ``earlier`` signed DP plans of the run (its training rounds: μ² adds).
    ValueError without an ``eval_epsilon`` or with another release kind."""
    if not settings.eval_epsilon > 0:
        raise ValueError("[round.dp] eval_epsilon is not set: a DP run cannot evaluate without it")
    kinds: dict[int, str] = {
        common_pb2.STATISTIC_KIND_SCORE_HISTOGRAM: "hist",
        common_pb2.STATISTIC_KIND_CONFUSION_COUNTS: "confusion",
    }
    noise: dict[str, ReleaseNoise] = {}
    for r in releases:
        kind = kinds.get(int(r.kind))
        if kind is None:
            raise ValueError(f"release {r.name}: kind {r.kind} is not an evaluation statistic")
        noise[r.name] = evaluation_noise(
            kind=kind,
            epsilon=settings.eval_epsilon,
            delta=settings.delta,
            n_classes=len(r.class_names),
            members=len(r.members),
            tolerated=settings.tolerated,
            local=plaintext,
            rows_per_individual=settings.images_per_patient,
        )
    stats = [
        StatisticRelease(r.name, "counts", tuple(r.members), len(r.class_names), r.shape)
        for r in releases
    ]
    eps = site_epsilons(stats, noise, sites=participants, delta=settings.delta)
    before = [x for p in earlier for x in plan_noise(p)[1]]
    run = site_epsilons(stats, noise, sites=participants, delta=settings.delta, earlier=before)
    z = calibrate_noise_multiplier(epsilon=settings.eval_epsilon, delta=settings.delta)
    return DpCalibration(
        replace(settings, epsilon=settings.eval_epsilon),
        noise,
        eps,
        z,
        site_epsilon_run=run,
    )


def apply_dp(plan: common_pb2.ReleasePlan, calibration: DpCalibration) -> None:
    """Write the noise of every release, the DP parameters and the site budgets into ``plan``."""
    s = calibration.settings
    plan.dp.CopyFrom(
        common_pb2.DpParams(
            enabled=True,
            clip_norm=s.clip_norm,
            delta=s.delta,
            epsilon=s.epsilon,
            unit=_UNITS[s.unit],
            images_per_patient=s.images_per_patient,
            max_positive_labels=s.max_positive_labels,
            noise_multiplier=calibration.noise_multiplier,
            run_rounds=calibration.run_rounds,
        )
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
        common_pb2.SiteBudget(
            site_id=site, epsilon=eps, delta=s.delta, epsilon_run=calibration.run_epsilon(site)
        )
        for site, eps in sorted(calibration.site_epsilon.items())
    )
