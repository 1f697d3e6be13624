"""`afl simulate`: the paper's experiment grid in process, no network (Table II layout; docs/method.md §2).

For each Missing-m setting (or a coverage file) the same per-site statistics feed:
- analytic 1 round and 2 rounds (eq. 13-22) under each ``gram_scope``;
- an independent Theorem-1 oracle: scikit-learn ``Ridge(alpha=γ, fit_intercept=False)`` fit on
  the pooled rows of each coverage set S_c with the sites' balanced targets. Its W is compared
  with the federated per-class W (max relative difference is reported, never assumed);
and once per run a centralised row (all training rows, every label known, pooled balanced ridge).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray
from sklearn.linear_model import Ridge
from tqdm import tqdm

from afl.core.aggregation import GRAM_SCOPES, GramScope, class_b_sums, federated_solve
from afl.core.data.assignment import CoverageSpec, format_assignment, missing_m_assignment
from afl.core.labels import balanced_targets
from afl.core.metrics import evaluate, predict_proba
from afl.core.packing import packed_length
from afl.core.refinement import RefinementParams, pseudo_label_projection, solve_round2
from afl.core.stats import LocalStats, local_statistics
from afl.lab.simulate.baselines import BaselineConfig, run_baseline
from afl.lab.simulate.dataset import FederatedDataset
from afl.lab.simulate.dp import ClippedSite, DPConfig, clip_sites, dp_solve

ORACLE = "oracle: pooled ridge per S_c (Theorem 1)"
CENTRAL = "centralised: all labels pooled"


def method_name(rounds: int, scope: GramScope) -> str:
    return f"analytic {rounds}-round ({scope})"


def dp_method_name(epsilon: float, scope: GramScope) -> str:
    return f"analytic 1-round DP ε={epsilon:g} ({scope})"


def analytic_communication(
    *, d: int, active: NDArray[np.bool_], scope: GramScope, rounds: int
) -> dict[str, int]:
    """Bytes each site sends and receives (float64 payloads; the busiest site is reported).

    Round 1 uploads the packed Gram and one b per class: only labelled classes under
    ``per-class``, every class under ``global`` (zeros for non-labelled ones, docs/protocol.md §6). Round 2
    uploads one b_pseudo per missing class (every class under ``global``). Each round downloads W.
    """
    num_classes = active.shape[1]
    labelled = int(active.sum(axis=1).max())
    b_up = num_classes if scope == "global" else labelled
    up = 8 * (packed_length(d) + d * b_up)
    if rounds == 2:
        up += (
            8
            * d
            * (num_classes if scope == "global" else num_classes - int(active.sum(axis=1).min()))
        )
    return {
        "rounds": rounds,
        "bytes_up_per_site": up,
        "bytes_down_per_site": 8 * d * num_classes * rounds,
    }


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


@dataclass(frozen=True)
class Setting:
    """A task-heterogeneity assignment: ``active[k, c]`` iff site k labels class c."""

    name: str
    active: NDArray[np.bool_]
    seed: int | None = None


@dataclass(frozen=True)
class SimulationConfig:
    settings: tuple[Setting, ...]
    gram_scopes: tuple[GramScope, ...] = GRAM_SCOPES
    rounds: tuple[int, ...] = (1, 2)
    gamma: float = 1.0
    refinement: RefinementParams = field(default_factory=RefinementParams)
    oracle: bool = True
    centralised: bool = True
    dp: DPConfig | None = None
    baselines: tuple[str, ...] = ()
    baseline_config: BaselineConfig = field(default_factory=BaselineConfig)

    def __post_init__(self) -> None:
        if not self.settings:
            raise ValueError("no setting to simulate")
        if set(self.rounds) - {1, 2} or not self.rounds:
            raise ValueError(f"rounds must be drawn from {{1, 2}}, got {self.rounds}")
        if set(self.gram_scopes) - set(GRAM_SCOPES) or not self.gram_scopes:
            raise ValueError(
                f"gram_scopes must be drawn from {GRAM_SCOPES}, got {self.gram_scopes}"
            )


def missing_settings(
    missing: Sequence[int], *, num_sites: int, num_classes: int, seed: int
) -> tuple[Setting, ...]:
    """Missing-m assignments, one seed for all (recorded in the results)."""
    return tuple(
        Setting(
            f"missing-{m}",
            missing_m_assignment(
                num_clients=num_sites, num_classes=num_classes, missing=m, seed=seed
            ),
            seed,
        )
        for m in missing
    )


def coverage_setting(spec: CoverageSpec, fed: FederatedDataset, name: str = "coverage") -> Setting:
    """A coverage file mapped onto the federation: classes by name, sites by position."""
    if len(spec.sites) != fed.num_sites:
        raise ValueError(
            f"coverage names {len(spec.sites)} sites, the federation has {fed.num_sites}"
        )
    missing = set(fed.classes) - set(spec.classes)
    if missing:
        raise ValueError(f"coverage does not mention classes {sorted(missing)}")
    order = [spec.classes.index(c) for c in fed.classes]
    return Setting(name, spec.active[:, order])


@contextmanager
def _timed(sink: dict[str, float], key: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    sink[key] = sink.get(key, 0.0) + time.perf_counter() - start


def _row(
    method: str, weights: NDArray[np.float64], fed: FederatedDataset, **extra: Any
) -> dict[str, Any]:
    metrics = evaluate(
        predict_proba(fed.test_features, weights), fed.test_labels, classes=fed.classes
    )
    return {"method": method, **metrics.to_json(), **extra}


def pooled_ridge(
    blocks: Sequence[tuple[NDArray[np.floating], NDArray[np.float64]]], *, gamma: float
) -> NDArray[np.float64]:
    """Independent oracle: scikit-learn ridge on vertically stacked rows and targets."""
    rows = np.vstack([np.asarray(h, dtype=np.float64) for h, _ in blocks])
    targets = np.concatenate([t for _, t in blocks])
    model = Ridge(alpha=gamma, fit_intercept=False, solver="cholesky").fit(rows, targets)
    coef: NDArray[np.float64] = np.asarray(model.coef_, dtype=np.float64)
    return coef.T if coef.ndim == 2 else coef[:, None]


def theorem1_oracle(
    fed: FederatedDataset, active: NDArray[np.bool_], *, gamma: float
) -> NDArray[np.float64]:
    """W from pooled rows of each S_c; classes with one cover share one fit (multi-target)."""
    targets = [
        balanced_targets(np.where(active[k], y, -1), active=active[k])
        for k, y in enumerate(fed.site_labels)
    ]
    covers: dict[tuple[int, ...], list[int]] = {}
    for c in range(len(fed.classes)):
        cover = tuple(k for k in range(fed.num_sites) if targets[k].usable[c])
        if cover:
            covers.setdefault(cover, []).append(c)
    weights = np.zeros((fed.d, len(fed.classes)))
    for cover, classes in covers.items():
        blocks = [(fed.site_features[k], targets[k].targets[:, classes]) for k in cover]
        weights[:, classes] = pooled_ridge(blocks, gamma=gamma)
    return weights


def _rel_diff(a: NDArray[np.float64], b: NDArray[np.float64]) -> float:
    cols = np.linalg.norm(b, axis=0) > 0
    if not cols.any():
        return 0.0
    return float(
        np.max(np.linalg.norm(a[:, cols] - b[:, cols], axis=0) / np.linalg.norm(b[:, cols], axis=0))
    )


def _round2(
    fed: FederatedDataset,
    stats: Sequence[LocalStats],
    active: NDArray[np.bool_],
    weights1: NDArray[np.float64],
    *,
    scope: GramScope,
    config: SimulationConfig,
) -> tuple[NDArray[np.float64], dict[str, Any]]:
    pseudo = [
        pseudo_label_projection(
            fed.site_features[k], weights=weights1, missing=~active[k], params=config.refinement
        )
        for k in range(fed.num_sites)
    ]
    _, plan = federated_solve(stats, gamma=config.gamma, gram_scope=scope)
    gram_total = np.sum([s.gram for s in stats], axis=0)
    b_real = class_b_sums(plan, [s.b for s in stats])
    b_pseudo = np.sum([p.b for p in pseudo], axis=0)
    weights2 = solve_round2(
        gram_total=gram_total,
        b_real=b_real,
        b_pseudo=b_pseudo,
        alpha=config.refinement.alpha,
        gamma=config.gamma,
    )
    contributors = {
        name: [fed.site_names[k] for k in range(fed.num_sites) if pseudo[k].contributes[c]]
        for c, name in enumerate(fed.classes)
    }
    return weights2, {"pseudo_label_contributors": contributors}


def _dp_rows(
    fed: FederatedDataset,
    clipped: Sequence[ClippedSite],
    setting: Setting,
    config: SimulationConfig,
    bar: tqdm[Any],
    on_weights: Callable[[str, str, NDArray[np.float64]], None] | None,
    timings: dict[str, float],
) -> list[dict[str, Any]]:
    assert config.dp is not None
    rows = []
    for scope in config.gram_scopes:
        for epsilon in config.dp.epsilons:
            with _timed(timings, "dp_solve_s"):
                weights, accounting = dp_solve(
                    clipped,
                    setting.active,
                    scope=scope,
                    epsilon=epsilon,
                    gamma=config.gamma,
                    config=config.dp,
                )
            name = dp_method_name(epsilon, scope)
            dp_info = {k: _json_float(v) for k, v in accounting.items()}
            rows.append(_row(name, weights, fed, rounds=1, gram_scope=scope, dp=dp_info))
            if on_weights:
                on_weights(setting.name, name, weights)
            bar.update()
    return rows


def simulate(
    fed: FederatedDataset,
    config: SimulationConfig,
    *,
    progress: bool = True,
    on_weights: Callable[[str, str, NDArray[np.float64]], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the grid; returns a JSON-ready dict (also holds the assignments and timings).
    ``progress`` shows a bar (a terminal); ``log`` gets one line per phase (logs, pipes)."""
    say = log or (lambda _: None)
    timings: dict[str, float] = {}
    per_setting = len(config.gram_scopes) * len(config.rounds) + int(config.oracle)
    if config.dp is not None:
        per_setting += len(config.gram_scopes) * len(config.dp.epsilons)
    per_setting += len(config.baselines)
    total = len(config.settings) * per_setting + int(config.centralised) + fed.num_sites
    bar = tqdm(total=total, disable=not progress, desc="simulate", unit="step", leave=False)
    all_active = np.ones(len(fed.classes), dtype=bool)
    full_stats = []
    say(f"local statistics of {fed.num_sites} sites (d = {fed.d})")
    with _timed(timings, "local_statistics_s"):
        for k in range(fed.num_sites):
            full_stats.append(
                local_statistics(fed.site_features[k], fed.site_labels[k], active=all_active)
            )
            bar.update()
    results: dict[str, Any] = {"data": fed.describe(), "settings": {}, "centralised": None}
    clipped: list[ClippedSite] = []
    for number, setting in enumerate(config.settings, start=1):
        say(f"setting {number}/{len(config.settings)}: {setting.name}")
        bar.set_postfix_str(setting.name)
        stats = [s.restricted_to(setting.active[k]) for k, s in enumerate(full_stats)]
        rows: list[dict[str, Any]] = []
        per_class_w1: NDArray[np.float64] | None = None
        for scope in config.gram_scopes:
            start = time.perf_counter()
            weights1, _ = federated_solve(stats, gamma=config.gamma, gram_scope=scope)
            solve_s = time.perf_counter() - start
            if scope == "per-class":
                per_class_w1 = weights1
            if 1 in config.rounds:
                rows.append(
                    _row(
                        method_name(1, scope),
                        weights1,
                        fed,
                        rounds=1,
                        gram_scope=scope,
                        solve_s=solve_s,
                        communication=analytic_communication(
                            d=fed.d, active=setting.active, scope=scope, rounds=1
                        ),
                    )
                )
                if on_weights:
                    on_weights(setting.name, method_name(1, scope), weights1)
                bar.update()
            if 2 in config.rounds:
                start = time.perf_counter()
                weights2, extra = _round2(
                    fed, stats, setting.active, weights1, scope=scope, config=config
                )
                rows.append(
                    _row(
                        method_name(2, scope),
                        weights2,
                        fed,
                        rounds=2,
                        gram_scope=scope,
                        solve_s=solve_s + time.perf_counter() - start,
                        communication=analytic_communication(
                            d=fed.d, active=setting.active, scope=scope, rounds=2
                        ),
                        **extra,
                    )
                )
                if on_weights:
                    on_weights(setting.name, method_name(2, scope), weights2)
                bar.update()
        if config.oracle:
            with _timed(timings, "oracle_s"):
                oracle_w = theorem1_oracle(fed, setting.active, gamma=config.gamma)
            extra_oracle: dict[str, Any] = {"rounds": None, "gram_scope": "per-class"}
            if per_class_w1 is not None:
                extra_oracle["max_rel_diff_vs_federated_per_class"] = _rel_diff(
                    per_class_w1, oracle_w
                )
            rows.append(_row(ORACLE, oracle_w, fed, **extra_oracle))
            if on_weights:
                on_weights(setting.name, ORACLE, oracle_w)
            bar.update()
        for name in config.baselines:
            with _timed(timings, f"baseline_{name}_s"):
                base = run_baseline(
                    name,
                    site_features=fed.site_features,
                    site_labels=fed.site_labels,
                    active=setting.active,
                    config=config.baseline_config,
                )
            metrics = evaluate(
                base.predict_proba(fed.test_features), fed.test_labels, classes=fed.classes
            )
            rows.append(
                {
                    "method": name,
                    **metrics.to_json(),
                    "rounds": config.baseline_config.rounds,
                    "gram_scope": None,
                    "solve_s": base.seconds,
                    "communication": base.communication,
                }
            )
            bar.update()
        if config.dp is not None:
            if not clipped:
                with _timed(timings, "dp_clip_s"):
                    clipped.extend(
                        clip_sites(fed.site_features, fed.site_labels, fed.site_patients, config.dp)
                    )
            rows.extend(_dp_rows(fed, clipped, setting, config, bar, on_weights, timings))
        results["settings"][setting.name] = {
            "seed": setting.seed,
            "assignment": {
                site: [c for c, on in zip(fed.classes, setting.active[k], strict=True) if on]
                for k, site in enumerate(fed.site_names)
            },
            "assignment_table": format_assignment(setting.active, fed.classes, fed.site_names),
            "skipped": {
                fed.site_names[k]: list(s.skipped) for k, s in enumerate(stats) if s.skipped
            },
            "rows": rows,
        }
    if config.centralised:
        say("centralised reference (pooled ridge)")
        with _timed(timings, "centralised_s"):
            pooled_labels = np.concatenate(fed.site_labels)
            pooled_targets = balanced_targets(pooled_labels, active=all_active).targets
            central_w = pooled_ridge(
                [(np.vstack(fed.site_features), pooled_targets)], gamma=config.gamma
            )
        results["centralised"] = _row(CENTRAL, central_w, fed, rounds=None, gram_scope=None)
        if on_weights:
            on_weights("centralised", CENTRAL, central_w)
        bar.update()
    bar.close()
    results["params"] = {
        "gamma": config.gamma,
        "tau": config.refinement.tau,
        "alpha": config.refinement.alpha,
        "delta_pos": config.refinement.delta_pos,
        "delta_neg": config.refinement.delta_neg,
        "threshold": 0.5,
        "gram_scopes": list(config.gram_scopes),
        "rounds": list(config.rounds),
        "baselines": dataclasses.asdict(config.baseline_config) if config.baselines else None,
    }
    results["timings"] = timings
    return results
