"""Text tables for results: the paper's Table II layout (methods × settings × BACC/AUC/mAP)."""

from __future__ import annotations

from typing import Any


def _fmt(value: float | None, *, percent: bool) -> str:
    if value is None:
        return "  n/a "
    return f"{100 * value:6.2f}" if percent else f"{value:6.4f}"


def table_ii(results: dict[str, Any]) -> str:
    """Rows: methods in first-seen order; column groups: settings; BACC and AUC in %, mAP as 0-1."""
    settings = list(results["settings"])
    methods: list[str] = []
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    for name in settings:
        for row in results["settings"][name]["rows"]:
            if row["method"] not in methods:
                methods.append(row["method"])
            cells[(row["method"], name)] = row["macro"]
    central = results.get("centralised")
    width = max([len(m) for m in methods] + [len(central["method"]) if central else 0, 6])
    group = 22
    lines = [f"Features: {results['data']['provenance']}"]
    if results["data"].get("surrogate"):
        lines.append(
            "NOTE: SURROGATE features - the protocol runs at real scale, figures are not the paper's."
        )
    lines.append(" " * width + " | " + " | ".join(f"{s:^{group}}" for s in settings))
    lines.append(
        " " * width + " | " + " | ".join(f"{'BACC':>6} {'AUC':>6} {'mAP':>7}" for _ in settings)
    )
    lines.append("-" * (width + (group + 3) * len(settings)))
    for method in methods:
        parts = []
        for s in settings:
            macro = cells.get((method, s))
            if macro is None:
                parts.append(" " * group)
            else:
                parts.append(
                    f"{_fmt(macro['bacc'], percent=True)} {_fmt(macro['auc'], percent=True)} "
                    f"{_fmt(macro['map'], percent=False)} "
                )
        lines.append(f"{method:<{width}} | " + " | ".join(parts))
    if central:
        m = central["macro"]
        lines.append("-" * (width + (group + 3) * len(settings)))
        lines.append(
            f"{central['method']:<{width}} | {_fmt(m['bacc'], percent=True)} "
            f"{_fmt(m['auc'], percent=True)} {_fmt(m['map'], percent=False)}  (every setting)"
        )
    checks = [
        (s, row["max_rel_diff_vs_federated_per_class"])
        for s in settings
        for row in results["settings"][s]["rows"]
        if "max_rel_diff_vs_federated_per_class" in row
    ]
    if checks:
        lines.append(
            "Theorem 1 check, max relative ‖W_fed - W_oracle‖ per class: "
            + ", ".join(f"{s} {v:.1e}" for s, v in checks)
        )
    pseudo = [
        (s, row["method"], sum(len(v) for v in row["pseudo_label_contributors"].values()))
        for s in settings
        for row in results["settings"][s]["rows"]
        if "pseudo_label_contributors" in row
    ]
    if pseudo:
        lines.append(
            "Round 2 pseudo-label contributions (site-class pairs passing τ, δ+, δ-): "
            + ", ".join(f"{s} {m.split('(')[-1].rstrip(')')} {n}" for s, m, n in pseudo)
        )
    return "\n".join(lines)


def assignments(results: dict[str, Any]) -> str:
    """Every setting's site × class assignment, printed with each result."""
    blocks = []
    for name, body in results["settings"].items():
        seed = f" (seed {body['seed']})" if body.get("seed") is not None else ""
        blocks.append(f"{name}{seed}:\n{body['assignment_table']}")
    return "\n\n".join(blocks)
