"""The [policy] a production kit starts from, and what `afl-client doctor` calls permissive
(docs/operations.md §3.4, docs/protocol.md M-171, M-172).

``afl-client init --import`` writes :func:`production_policy_toml` into a new ``client.toml``: the
site's own software writes it (the operator's template still carries no [policy]), so a
production site is never left at the library defaults by omission. Its values are the protective
ones, written out so that a reviewer sees them:

* ``allowed_aggregation = ["mask", "ckks"]``: mode pinning, a plaintext plan is refused;
  ``ckks_decryptor`` pinned to the roster's decryptor when the roster names one;
* ``max_epsilon = 4``, ``lifetime_epsilon = 10`` at ``lifetime_delta = 1e-5``: DP is required
  and the site's lifetime loss is finite (a plan without DP costs ε = ∞ and is refused); a
  federation without DP changes these keys on purpose, and doctor says so;
* ``disclose_row_bounds = false``: the row count and largest row norm stay local (a DP run takes
  N from the coordinator's ``[round.dp] max_samples``);
* ``min_cohort = 3``, ``allow_exposure = false``, ``disclose_coverage = false``,
  ``privacy_unit = "patient"``.

The demo kits of ``afl provision`` say ``profile = "development"`` (permissive: no DP, bounds
disclosed), production kits ``profile = "production"``.
"""

from __future__ import annotations

import math

from afl.client.config import PROTECTED_AGGREGATION, LocalPolicy

__all__ = [
    "PRODUCTION_LIFETIME_EPSILON",
    "PRODUCTION_MAX_EPSILON",
    "permissive_settings",
    "policy_summary",
    "production_policy_toml",
]

#: The most ε one run may cost a production site, and its whole ledger (docs/operations.md §7).
PRODUCTION_MAX_EPSILON = 4.0
PRODUCTION_LIFETIME_EPSILON = 10.0


def production_policy_toml(*, ckks_decryptor: str | None) -> str:
    """The [policy] table (TOML text, with comments) a production ``client.toml`` starts with."""
    modes = ", ".join(f'"{m}"' for m in PROTECTED_AGGREGATION)
    lines = [
        "",
        "# Written by `afl-client init --import`: the protective production defaults",
        "# (docs/operations.md §3.4). A federation without DP sets max_epsilon and",
        "# lifetime_epsilon to inf (and disclose_row_bounds = true for masked rounds) on purpose;",
        "# `afl-client doctor` lists every permissive value.",
        "[policy]",
        'profile = "production"',
        f"allowed_aggregation = [{modes}]",
    ]
    if ckks_decryptor is not None:
        lines.append(f'ckks_decryptor = "{ckks_decryptor}"')
    lines += [
        "min_cohort = 3",
        "allow_exposure = false",
        "disclose_coverage = false",
        "disclose_row_bounds = false",
        f"max_epsilon = {PRODUCTION_MAX_EPSILON:g}",
        f"lifetime_epsilon = {PRODUCTION_LIFETIME_EPSILON:g}",
        "lifetime_delta = 1e-5",
        'privacy_unit = "patient"',
        "",
    ]
    return "\n".join(lines)


def permissive_settings(policy: LocalPolicy) -> list[str]:
    """Each setting of ``policy`` less protective than the production defaults, with what it
    lets through (empty for the production policy)."""
    found = []
    if "plaintext" in policy.allowed_aggregation:
        found.append(
            "allowed_aggregation includes plaintext: the coordinator may see the statistics"
        )
    if math.isinf(policy.lifetime_epsilon):
        found.append(
            "lifetime_epsilon = inf: no lifetime privacy budget, plans without DP accepted"
        )
    if math.isinf(policy.max_epsilon):
        found.append("max_epsilon = inf: no per-run privacy budget")
    if policy.disclose_row_bounds:
        found.append("disclose_row_bounds = true: N and the largest row norm leave the site")
    if policy.allow_exposure:
        found.append("allow_exposure = true: plans that determine this site's statistics accepted")
    if policy.min_cohort < 3:
        found.append(f"min_cohort = {policy.min_cohort}: releases of fewer than 3 members accepted")
    if policy.privacy_unit != "patient":
        found.append(f'privacy_unit = "{policy.privacy_unit}": image-level DP plans accepted')
    return found


def policy_summary(policy: LocalPolicy) -> str:
    """One line: the effective policy (what doctor prints)."""
    decryptor = policy.ckks_decryptor or "none (CKKS refused)"
    return (
        f"policy ({policy.profile or 'no profile'}): modes {list(policy.allowed_aggregation)}, "
        f"decryptor {decryptor}, min_cohort {policy.min_cohort}, max_epsilon "
        f"{policy.max_epsilon:g}, lifetime_epsilon {policy.lifetime_epsilon:g} at δ "
        f"{policy.lifetime_delta:g}, disclose_row_bounds {str(policy.disclose_row_bounds).lower()}"
        f", disclose_coverage {str(policy.disclose_coverage).lower()}"
    )
