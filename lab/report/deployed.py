"""`afl report EXPORT_DIR`: the deployed-round view of one published model, from an `afl export`
folder (docs/operations.md §14): the model card (what must not be done with the model first), the
round's facts, the backbone, the evaluations the card carries (a site's local evaluation with
bootstrap intervals, a federated evaluation), and the calibration (reliability diagrams before
and after when the calibration file carries them, and the fitted maps). One self-contained HTML
file like the simulation report (:mod:`afl.lab.report.simulation`): inline CSS and PNGs, every text escaped.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

from afl.core.evaluation.calibration import Calibration, CalibrationError
from afl.lab.report.plots import calibration_map_plot, evaluation_plot, reliability_plot
from afl.lab.report.simulation import ReportError, html_page, html_table

__all__ = ["is_export_folder", "render_deployed_report", "write_deployed_report"]


def is_export_folder(path: Path) -> bool:
    """True for an `afl export` folder (or its model_card.json)."""
    return (path / "model_card.json").is_file() if path.is_dir() else path.name == "model_card.json"


def _kv(rows: dict[str, Any]) -> str:
    def text(v: Any) -> str:
        if v is None:
            return "unknown"
        if isinstance(v, dict | list):
            return json.dumps(v, ensure_ascii=False)
        return str(v)

    return html_table(
        ["field", "value"], [(escape(k), escape(text(v))) for k, v in rows.items()], cls="kv"
    )


def _metric_cell(v: Any) -> str:
    if isinstance(v, dict):
        est, lo, hi = v.get("estimate"), v.get("low"), v.get("high")
        if est is None:
            return "n/a"
        interval = "" if lo is None or hi is None else f" [{lo:.3f}, {hi:.3f}]"
        return f"{est:.4f}{interval}"
    return "n/a" if v is None else f"{v:.4f}"


def _evaluations(metrics: dict[str, Any]) -> list[str]:
    if not metrics:
        return [
            '<p class="note">No evaluation in the card: run <code>afl-client evaluate</code> at '
            "a site (its report then feeds <code>afl export</code>), or pass a federated "
            "evaluation with <code>afl export --evaluation FILE</code>.</p>"
        ]
    out = []
    for title, body in metrics.items():
        per_class = body.get("per_class") or {}
        out.append(f"<h3>{escape(title)}</h3>")
        notes = [str(body[k]) for k in ("source", "data") if body.get(k)]
        if body.get("in_sample"):
            notes.append("in-sample: evaluated on the training rows (optimistic)")
        if isinstance(body.get("bootstrap"), dict):
            b = body["bootstrap"]
            notes.append(
                f"{b.get('confidence')} intervals, {b.get('resamples')} bootstrap resamples"
            )
        if notes:
            out.append(f'<p class="note">{escape("; ".join(notes))}</p>')
        rows = []
        for name, row in per_class.items():
            counts = f"{row['n_pos']} / {row['n_neg']}" if "n_pos" in row and "n_neg" in row else ""
            rows.append(
                [escape(name), counts, *(_metric_cell(row.get(k)) for k in ("bacc", "auc", "ap"))]
            )
        out.append(html_table(["class", "positives / negatives", "BACC", "AUC", "AP"], rows))
        if per_class:
            out.append(
                f'<img src="{evaluation_plot(per_class, title=title)}" alt="{escape(title)}">'
            )
    return out


def _span(calibration: Calibration) -> float:
    """Score range to draw: the isotonic fit's support, or where Platt's map goes from about
    0.02 to 0.98 (|a z + b| <= 4)."""
    spans = [
        max(abs(v) for v in c.x)
        if c.method == "isotonic"
        else (4.0 + abs(c.intercept)) / abs(c.slope)
        for c in calibration.classes
        if c.fitted and (c.x or c.slope)
    ]
    return max(spans, default=1.0)


def _calibration(folder: Path, card: dict[str, Any]) -> list[str]:
    info = card.get("calibration")
    if not info:
        return [
            '<p class="note">No calibration: the probabilities output is σ(z), close to 0.5 for '
            "every image (docs/method.md §3.3).</p>"
        ]
    path = folder / str(info.get("file", "calibration.json"))
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        calibration = Calibration.from_json(doc)
    except (OSError, ValueError, CalibrationError) as exc:
        return [
            f'<p class="note">Calibration file {escape(str(path))} unreadable: {escape(str(exc))}</p>'
        ]
    out = [
        f'<p class="note">{escape(calibration.method)} calibration fitted for model '
        f"{escape(calibration.model_sha256)}: an addition, the decision rule stays σ(z) &gt; "
        "0.5.</p>"
    ]
    reliability = (doc.get("reliability") or {}).get("per_class")
    if reliability:
        data = str(doc["reliability"].get("data", ""))
        out.append(
            f'<img src="{reliability_plot(reliability, title=f"Reliability, {data}")}" alt="reliability">'
        )
    out.append(
        f'<img src="{calibration_map_plot(calibration, span=_span(calibration))}" alt="calibration maps">'
    )
    return out


def render_deployed_report(folder: Path, *, title: str | None = None) -> str:
    """The HTML of the deployed-round view of an `afl export` folder."""
    card_path = folder / "model_card.json" if folder.is_dir() else folder
    folder = card_path.parent
    try:
        card = json.loads(card_path.read_text(encoding="utf-8"))
        model, classes = card["model"], card["classes"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ReportError(f"{card_path} is not an afl model card ({exc})") from exc
    title = (
        title or f"Deployed model: round {model.get('round_id')} of {model.get('federation_id')}"
    )
    warnings = card.get("must_not_be_used_for") or []
    training = card.get("training") or {}
    banner = (
        '<div class="banner surrogate">' + escape(warnings[0]) + "</div>"
        if training.get("surrogate_features") or (card.get("backbone") or {}).get("trained_on")
        else ""
    )
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="note">Classes: {escape(", ".join(classes))}</p>',
        banner,
        "<h2>Must not be used for</h2>",
        "<ul>" + "".join(f"<li>{escape(w)}</li>" for w in warnings) + "</ul>",
        "<h2>Model</h2>",
        _kv(model),
        "<h2>Training</h2>",
        _kv(training),
        "<h2>Backbone and preprocessing</h2>",
        _kv(card.get("backbone") or {}),
        "<h2>Inputs, outputs, decision rule</h2>",
        _kv(
            {
                **card.get("inputs", {}),
                **card.get("outputs", {}),
                "decision rule": card.get("decision_rule"),
            }
        ),
        "<h2>Evaluation</h2>",
        *_evaluations(card.get("metrics") or {}),
        "<h2>Calibration</h2>",
        *_calibration(folder, card),
        "<h2>Files</h2>",
        _kv(card.get("files") or {}),
    ]
    sums = folder / "SHA256SUMS"
    if sums.is_file():
        body.append(f"<pre>{escape(sums.read_text(encoding='utf-8'))}</pre>")
    return html_page(title, body)


def write_deployed_report(folder: Path, out_path: Path, *, title: str | None = None) -> Path:
    html = render_deployed_report(folder, title=title)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(html, encoding="utf-8")
    return out_path
