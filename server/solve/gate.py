"""The validation gate: a run's model is published only if its pooled evaluation meets the floor
the run declares (docs/protocol.md §6.2, docs/operations.md §6.2).

A run with a ``[round.gate]`` table does not publish the model its final round solves. The
coordinator signs it as a CANDIDATE (context ``"candidate-model"``, never valid as a published
model), the round waits in ROUND_STAGE_VALIDATING, and the run's evaluation round
(:mod:`afl.server.solve.evaluation`, under the run's aggregation mode) has the model's contributors
score the candidate on their hold-out rows. From the released sums the coordinator computes the
pooled per-class ROC AUC (:func:`afl.core.evaluation.federated.pooled_metrics`) and
:func:`gate_verdict` compares it with the floor:

    passed  <=>  AUC_c >= min_auc for every class c with both labels among the scored rows
                 and  macro AUC = mean_c AUC_c >= min_macro_auc
                 and  at least ``min_sites`` sites scored it

(defaults: ``min_auc = 0.5``, "no class below chance"; ``min_macro_auc = 0.5``; ``min_sites = 2``).
A class without both labels among the scored rows has no AUC and fails the gate when
``require_every_class`` (default true): the floor is then unchecked for it.

Passed: the candidate's ``Model`` bytes are signed again with context ``"model"`` and published
(the round becomes PUBLISHED), with the signed evaluation. Failed: nothing is published; the
round is ABORTED and the run ends FAILED with :func:`GateVerdict.reason` (the failing classes and
the pooled figures) in the audit log (event ``gate``), the run's reason (``afl admin status``)
and the signed evaluation every scoring site receives (its ``gate`` entry; each site's report
names the reason).

A site without hold-out rows refuses the gate's plan saying so; the round is re-planned with the
others when at least ``min_sites`` remain, else the run ends FAILED.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from afl.core.evaluation.federated import EvaluationStats, pooled_metrics

__all__ = ["GATE_KEYS", "GateSettings", "GateVerdict", "gate_settings_from_table", "gate_verdict"]

GATE_KEYS = ("min_auc", "min_macro_auc", "min_sites", "require_every_class")


@dataclass(frozen=True)
class GateSettings:
    """The floor a candidate must meet ([round.gate] of a run)."""

    min_auc: float = 0.5
    min_macro_auc: float = 0.5
    min_sites: int = 2
    require_every_class: bool = True


def gate_settings_from_table(table: Mapping[str, Any]) -> GateSettings:
    """The validated [round.gate] table; ValueError naming the key."""
    unknown = sorted(set(table) - set(GATE_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; known: {list(GATE_KEYS)}")
    floors: dict[str, float] = {}
    for key in ("min_auc", "min_macro_auc"):
        value = table.get(key, 0.5)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} must be a number, got {value!r}")
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{key} must lie in [0, 1] (an AUC), got {value}")
        floors[key] = float(value)
    sites = table.get("min_sites", 2)
    if isinstance(sites, bool) or not isinstance(sites, int) or sites < 1:
        raise ValueError(f"min_sites must be an integer >= 1, got {sites!r}")
    every = table.get("require_every_class", True)
    if not isinstance(every, bool):
        raise ValueError(f"require_every_class must be true or false, got {every!r}")
    return GateSettings(floors["min_auc"], floors["min_macro_auc"], sites, every)


@dataclass(frozen=True)
class GateVerdict:
    """The gate's decision on one candidate, with the pooled figures it rests on."""

    passed: bool
    per_class_auc: Mapping[str, float | None]
    macro_auc: float | None
    failing: tuple[str, ...]  # classes below min_auc (or without an AUC, when required)
    members: int
    settings: GateSettings

    def reason(self) -> str:
        """One line: why the candidate failed ("" when it passed)."""
        if self.passed:
            return ""
        parts = []
        if self.members < self.settings.min_sites:
            parts.append(f"{self.members} site(s) scored it, min_sites = {self.settings.min_sites}")
        if self.failing:
            figures = ", ".join(f"{c} AUC {_fmt(self.per_class_auc.get(c))}" for c in self.failing)
            parts.append(f"classes below min_auc {self.settings.min_auc:g}: {figures}")
        if self.macro_auc is None or self.macro_auc < self.settings.min_macro_auc:
            parts.append(
                f"macro AUC {_fmt(self.macro_auc)} < min_macro_auc {self.settings.min_macro_auc:g}"
            )
        return "validation gate failed: " + "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "reason": self.reason(),
            "failing_classes": list(self.failing),
            "per_class_auc": dict(self.per_class_auc),
            "macro_auc": self.macro_auc,
            "scored_by": self.members,
            "floor": {
                "min_auc": self.settings.min_auc,
                "min_macro_auc": self.settings.min_macro_auc,
                "min_sites": self.settings.min_sites,
                "require_every_class": self.settings.require_every_class,
            },
        }


def _fmt(x: float | None) -> str:
    return "undefined" if x is None else f"{x:.4f}"


def gate_verdict(stats: EvaluationStats, *, members: int, settings: GateSettings) -> GateVerdict:
    """Compare the pooled per-class and macro ROC AUC of ``stats`` (the gate's released sums)
    with the floor (module docstring)."""
    metrics = pooled_metrics(stats)
    per_class: dict[str, float | None] = {}
    failing = []
    for name, auc in zip(stats.classes, metrics.auc, strict=True):
        value = None if math.isnan(float(auc)) else float(auc)
        per_class[name] = value
        if (value is None and settings.require_every_class) or (
            value is not None and value < settings.min_auc
        ):
            failing.append(name)
    macro = None if math.isnan(metrics.macro_auc) else metrics.macro_auc
    passed = (
        not failing
        and macro is not None
        and macro >= settings.min_macro_auc
        and members >= settings.min_sites
    )
    return GateVerdict(passed, per_class, macro, tuple(failing), members, settings)
