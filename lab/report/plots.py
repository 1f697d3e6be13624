"""Figures of `afl report`, each returned as an inline ``data:image/png;base64,...`` URI.

Figures are built with ``matplotlib.figure.Figure`` directly (the Agg canvas; no pyplot state, no
display). ROC curves (per class, every saved method, on the
full test set) need the scores σ(H W) (paper eq. 23), so they are drawn only when the results
carry a ``saved`` section from ``afl simulate --save-dir``: the test feature cache and every
solved W. Curves come from :func:`afl.core.metrics.predict_proba` and
:func:`sklearn.metrics.roc_curve`; the AUCs are in the tables.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from sklearn.metrics import roc_curve

from afl.core.data.featurecache import FeatureCacheError, open_cache
from afl.core.metrics import predict_proba

__all__ = [
    "RocFigures",
    "calibration_map_plot",
    "data_uri",
    "evaluation_plot",
    "macro_figure",
    "macro_plot",
    "per_class_plot",
    "reliability_plot",
    "roc_figures",
]

METRICS = (("bacc", "BACC"), ("auc", "AUC"))


def data_uri(fig: Figure, *, dpi: int = 90) -> str:
    """PNG bytes of ``fig`` as a data URI."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _value(x: Any) -> float:
    return float(x) if isinstance(x, int | float) else math.nan


def macro_plot(results: dict[str, Any]) -> str:
    """:func:`macro_figure` as a PNG data URI."""
    return data_uri(macro_figure(results))


def macro_figure(results: dict[str, Any]) -> Figure:
    """Macro BACC and AUC of every method across the settings (heterogeneity on the x axis), on a
    0-100 % axis; with one setting, a bar per method (two points on an autoscaled axis would
    make a difference of a fraction of a point look like a gap)."""
    settings = list(results["settings"])
    methods: dict[str, dict[str, dict[str, Any]]] = {}
    for name in settings:
        for row in results["settings"][name]["rows"]:
            methods.setdefault(row["method"], {})[name] = row["macro"]
    central = results.get("centralised")
    if len(settings) == 1:
        names = list(methods)
        fig = Figure(figsize=(11, 0.42 * len(names) + 1.3))
        axes = fig.subplots(1, 2, sharey=True)
        for ax, (key, label) in zip(axes, METRICS, strict=True):
            values = [100 * _value(methods[m].get(settings[0], {}).get(key)) for m in names]
            ax.barh(range(len(names)), values, color=[f"C{i % 10}" for i in range(len(names))])
            for i, v in enumerate(values):
                ax.text(min(v, 100) + 0.8, i, f"{v:.1f}", va="center", fontsize=9)
            if central:
                ax.axvline(
                    100 * _value(central["macro"][key]), color="k", linestyle=":",
                    label="centralised",
                )  # fmt: skip
                ax.legend(fontsize=9, loc="lower right")
            ax.set_xlim(0, 100)
            ax.set_xlabel(f"macro {label} (%), {settings[0]}", fontsize=10)
            ax.grid(axis="x", alpha=0.3)
        axes[0].set_yticks(range(len(names)), names, fontsize=9)
        axes[0].invert_yaxis()
        fig.tight_layout()
        return fig
    fig = Figure(figsize=(11, 4.5))
    axes = fig.subplots(1, 2)
    for ax, (key, label) in zip(axes, METRICS, strict=True):
        for method, by_setting in methods.items():
            ys = [_value(by_setting.get(s, {}).get(key)) for s in settings]
            ax.plot(settings, [100 * y for y in ys], marker="o", label=method)
        if central:
            ax.axhline(
                100 * _value(central["macro"][key]), color="k", linestyle=":", label="centralised"
            )
        ax.set_ylim(0, 100)
        ax.set_ylabel(f"macro {label} (%)", fontsize=10)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=9, loc="lower left")
    fig.tight_layout()
    return fig


def per_class_plot(results: dict[str, Any], setting: str) -> str:
    """Grouped bars: per-class BACC and AUC of each method in one setting."""
    rows = results["settings"][setting]["rows"]
    classes = list(results["data"]["classes"])
    x = np.arange(len(classes))
    width = 0.8 / max(len(rows), 1)
    legend_h = 0.22 * math.ceil(len(rows) / 3) + 0.3
    fig = Figure(figsize=(11, 6 + legend_h))
    axes = fig.subplots(2, 1, sharex=True)
    for ax, (key, label) in zip(axes, METRICS, strict=True):
        lowest = 100.0
        for i, row in enumerate(rows):
            ys = [100 * _value(row["per_class"].get(c, {}).get(key)) for c in classes]
            ax.bar(x - 0.4 + (i + 0.5) * width, ys, width, label=row["method"], color=f"C{i % 10}")
            lowest = min([lowest, *(y for y in ys if math.isfinite(y))])
        ax.set_ylim(max(0.0, min(40.0, 10 * math.floor(lowest / 10) - 10)), 100)
        ax.set_ylabel(f"{label} (%)")
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(x, classes, rotation=30, ha="right", fontsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", fontsize=9, ncol=3)
    fig.suptitle(f"Per-class metrics, {setting}", fontsize=9)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.94, bottom=(legend_h + 0.55) / (6 + legend_h))
    return data_uri(fig)


@dataclass(frozen=True)
class RocFigures:
    """One ROC figure per setting (data URIs) and a note on what was or was not drawn."""

    figures: dict[str, str]
    note: str


def _resolve(path: str, base_dir: Path | None) -> Path:
    """``path`` as saved (relative to simulate's working directory), else found under base_dir.

    ``afl simulate --save-dir out`` records ``out/weights/...`` and writes ``out/results.json``;
    from another directory the longest tail of the path that exists under base_dir is used.
    """
    p = Path(path)
    if p.is_absolute() or p.exists() or base_dir is None:
        return p
    for k in range(len(p.parts)):
        candidate = base_dir.joinpath(*p.parts[k:])
        if candidate.exists():
            return candidate
    return base_dir / p


def _roc_figure(setting: str, curves: dict[str, Any], classes: list[str]) -> str:
    cols = min(4, len(classes))
    nrows = math.ceil(len(classes) / cols)
    legend_h = 0.34 * math.ceil(len(curves) / 2) + 0.5  # readable legend: 10 pt, 2 columns
    height = 2.8 * nrows + legend_h + 0.4
    fig = Figure(figsize=(3.0 * cols, height))
    axes = fig.subplots(nrows, cols, squeeze=False)
    handles: dict[str, Any] = {}
    for c, name in enumerate(classes):
        ax = axes[c // cols][c % cols]
        for i, (method, (probs, labels)) in enumerate(curves.items()):
            y = labels[:, c] == 1
            if y.all() or not y.any():
                continue
            fpr, tpr, _ = roc_curve(y, probs[:, c])
            (line,) = ax.plot(fpr, tpr, linewidth=1.2, color=f"C{i % 10}")
            handles.setdefault(method, line)
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(name, fontsize=10)
        ax.tick_params(labelsize=8)
    for c in range(len(classes), nrows * cols):
        axes[c // cols][c % cols].axis("off")
    fig.legend(list(handles.values()), list(handles), loc="lower center", fontsize=10, ncol=2)
    fig.suptitle(f"ROC curves per class, {setting} (false vs true positive rate)", fontsize=11)
    fig.subplots_adjust(
        left=0.06, right=0.98, top=1 - 0.7 / height, hspace=0.4, wspace=0.25,
        bottom=(legend_h + 0.2) / height,
    )  # fmt: skip
    return data_uri(fig, dpi=90)


def roc_figures(results: dict[str, Any], *, base_dir: Path | None = None) -> RocFigures:
    """ROC figures from the ``saved`` section, or a note saying why there are none."""
    saved = results.get("saved")
    if not saved or not saved.get("weights") or not saved.get("data"):
        return RocFigures(
            {},
            "ROC curves need the scores: run `afl simulate --save-dir DIR` "
            "and report DIR/results.json.",
        )
    classes = list(results["data"]["classes"])
    try:
        test = open_cache(_resolve(str(saved["data"]), base_dir) / "test")
    except (FeatureCacheError, FileNotFoundError) as exc:
        return RocFigures({}, f"ROC curves not drawn: the saved test cache cannot be read ({exc}).")
    if list(test.meta.classes) != classes:
        return RocFigures({}, "ROC curves not drawn: the saved test cache has other classes.")
    by_setting: dict[str, dict[str, Any]] = {}
    missing = []
    for key, path in saved["weights"].items():
        setting, _, method = str(key).partition("/")
        file = _resolve(str(path), base_dir)
        if not file.exists():
            missing.append(str(file))
            continue
        probs = predict_proba(test.features, np.load(file))
        by_setting.setdefault(setting, {})[method] = (probs, test.labels)
    central = by_setting.pop("centralised", {})
    figures = {
        setting: _roc_figure(setting, {**curves, **central}, classes)
        for setting, curves in by_setting.items()
        if setting in results["settings"]
    }
    note = f"ROC curves on the {test.meta.n} test rows of {test.root}."
    unsaved = sorted(
        {row["method"] for b in results["settings"].values() for row in b["rows"]}
        - {m for curves in by_setting.values() for m in curves}
    )
    if unsaved:
        note += f" No saved weights (so no curve) for: {', '.join(unsaved)}."
    if missing:
        note += f" {len(missing)} saved weight files were not found (e.g. {missing[0]})."
    return RocFigures(figures, note)


def _grid(n: int, *, width: float = 3.0, height: float = 2.8) -> tuple[Figure, Any, int]:
    cols = min(4, max(n, 1))
    rows = math.ceil(max(n, 1) / cols)
    fig = Figure(figsize=(width * cols, height * rows + 0.6))
    return fig, fig.subplots(rows, cols, squeeze=False), cols


def reliability_plot(per_class: dict[str, dict[str, Any]], *, title: str) -> str:
    """Reliability diagrams, one panel per class: observed frequency of positives against the
    mean predicted probability per probability bin, one line per source (σ(z), calibrated)."""
    classes = list(per_class)
    fig, axes, cols = _grid(len(classes))
    for i, name in enumerate(classes):
        ax = axes[i // cols][i % cols]
        for j, (source, rel) in enumerate(per_class[name].items()):
            xs = [_value(v) for v in rel["mean_predicted"]]
            ys = [_value(v) for v in rel["observed"]]
            ece = _value(rel.get("ece"))
            ax.plot(
                xs, ys, marker="o", markersize=3, color=f"C{j}", label=f"{source} (ECE {ece:.3f})"
            )
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=0.8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("mean predicted probability", fontsize=6)
        ax.set_ylabel("observed frequency", fontsize=6)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=6, loc="upper left")
    for i in range(len(classes), axes.size):
        axes[i // cols][i % cols].axis("off")
    fig.suptitle(title, fontsize=8, wrap=True)
    fig.tight_layout()
    return data_uri(fig, dpi=80)


def calibration_map_plot(calibration: Any, *, span: float) -> str:
    """The fitted maps z -> calibrated probability, with σ(z) for reference, over |z| <= span."""
    z = np.linspace(-span, span, 401)
    classes = list(calibration.class_names)
    fig, axes, cols = _grid(len(classes))
    for i, name in enumerate(classes):
        ax = axes[i // cols][i % cols]
        ax.plot(z, 1 / (1 + np.exp(-z)), color="grey", linestyle=":", label="σ(z)")
        ax.plot(z, calibration.classes[i].probabilities(z), color="C1", label=calibration.method)
        ax.set_ylim(0, 1)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("score z = h · w_c", fontsize=6)
        ax.set_ylabel("probability", fontsize=6)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=6)
    for i in range(len(classes), axes.size):
        axes[i // cols][i % cols].axis("off")
    fig.suptitle("Calibration maps", fontsize=8)
    fig.tight_layout()
    return data_uri(fig, dpi=80)


def evaluation_plot(per_class: dict[str, dict[str, Any]], *, title: str) -> str:
    """BACC, AUC and AP per class as bars, with the bootstrap interval when one is given."""
    classes = list(per_class)
    x = np.arange(len(classes))
    fig = Figure(figsize=(11, 3.6))
    axes = fig.subplots(1, 3)
    for ax, key in zip(axes, ("bacc", "auc", "ap"), strict=True):
        est, low, high = [], [], []
        for name in classes:
            v = per_class[name].get(key)
            if isinstance(v, dict):
                e = _value(v.get("estimate"))
                est.append(e)
                low.append(e - _value(v.get("low")))
                high.append(_value(v.get("high")) - e)
            else:
                est.append(_value(v))
                low.append(0.0)
                high.append(0.0)
        err = np.nan_to_num(np.array([low, high]), nan=0.0)
        ax.bar(x, est, yerr=err, capsize=3, color="C0")
        ax.set_xticks(x, classes, rotation=30, ha="right", fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_title(key.upper(), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return data_uri(fig, dpi=80)
