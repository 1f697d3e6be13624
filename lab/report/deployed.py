"""`afl report EXPORT_DIR`: the deployed-round view of one published model, from an `afl export`
folder (docs/operations.md §14): the model card (what must not be done with the model first), the
round's facts, the backbone, the evaluations the card carries (a site's local evaluation with
bootstrap intervals, a federated evaluation), and the calibration (reliability diagrams before
and after when the calibration file carries them, and the fitted maps). One self-contained HTML
file like the simulation report (:mod:`afl.lab.report.simulation`): inline CSS and PNGs, every text escaped.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from html import escape
from pathlib import Path
from typing import Any

from afl.client.model.model_card import dp_description
from afl.core.evaluation.calibration import Calibration, CalibrationError
from afl.lab.report.plots import calibration_map_plot, evaluation_plot, reliability_plot
from afl.lab.report.simulation import ReportError, html_page, html_table

__all__ = ["is_export_folder", "render_deployed_report", "write_deployed_report"]


def is_export_folder(path: Path) -> bool:
    """True for an `afl export` folder (or its model_card.json)."""
    return (path / "model_card.json").is_file() if path.is_dir() else path.name == "model_card.json"


#: What a clinician reads instead of the card's field names.
_LABELS = {
    "federation_id": "Federation",
    "round_id": "Round",
    "round_number": "Round number",
    "model_sha256": "Model fingerprint (SHA-256)",
    "plan_sha256": "Plan fingerprint (SHA-256)",
    "created_unix_ms": "Published",
    "gamma": "Ridge regularisation γ",
    "decision_threshold": "Decision threshold on σ(z)",
    "contributors": "Contributing sites",
    "number_of_sites": "Number of contributing sites",
    "backbone": "Backbone",
    "shape": "Head size",
    "facts_from": "Facts from",
    "aggregation": "Protection of the sites' statistics",
    "gram_scope": "Gram scope",
    "participants": "Participants",
    "differential_privacy": "Differential privacy",
    "training_images": "Training images",
    "surrogate_features": "Trained on surrogate features",
    "name": "Backbone",
    "description": "Description",
    "feature_dim": "Features per image",
    "weights": "Weights file",
    "weights_sha256": "Weights fingerprint (SHA-256)",
    "random_init": "Random (untrained) backbone weights",
    "trained_on": "Head trained on features of",
    "preprocessing": "Preprocessing",
    "image": "Input image",
    "probabilities": "Output: probabilities",
    "logits": "Output: logits",
    "decision rule": "Decision rule",
    "torchscript": "TorchScript model",
    "onnx": "ONNX model",
    "calibration": "Calibration",
    "card_json": "Model card (JSON)",
    "card_markdown": "Model card (Markdown)",
    "checksums": "Checksums",
}
_AGGREGATION = {
    "mask": "pairwise masking (secure aggregation): the coordinator saw only the sum",
    "ckks": "CKKS homomorphic encryption with a separate decryptor",
    "plaintext": "none: the sites sent their statistics in the clear",
}
_PREPROCESSOR = re.compile(r"Preprocessor\((.*)\)")


def _label(key: str) -> str:
    return _LABELS.get(key, key.replace("_", " ").capitalize())


def _published(ms: Any) -> str:
    when = datetime.fromtimestamp(int(ms) / 1000, tz=UTC)
    return when.strftime("%d %B %Y, %H:%M UTC").lstrip("0")


def _training_images(images: dict[str, Any]) -> str:
    known = images.get("known") or {}
    per_site = ", ".join(f"{site}: {n:,} images" for site, n in known.items())
    if images.get("total") is not None:
        return f"{images['total']:,} images ({per_site})"
    if known:
        return f"total not known to the exporting party; {per_site}"
    return "not known to the exporting party (the coordinator does not learn how many images a site holds)"


def _preprocessing(text: str) -> str:
    """``Preprocessor(kind='xrv', crop_size=224, ...)`` in words."""
    match = _PREPROCESSOR.fullmatch(text.strip())
    if not match:
        return text
    fields = dict(re.findall(r"(\w+)=['\"]?([^,'\"]+)['\"]?", match[1]))
    crop, resize = fields.get("crop_size", "?"), fields.get("resize_size", "?")
    how = fields.get("interpolation", "bilinear")
    if fields.get("kind") == "xrv":
        return (
            f"grayscale scaled to [−1024, 1024] (TorchXRayVision), square centre crop, resized "
            f"to {crop} × {resize} pixels ({how})"
        )
    return (
        f"short side resized to {resize} pixels ({how}), centre crop {crop} × {crop} pixels, "
        "3 channels, ImageNet mean and standard deviation"
    )


def _value(key: str, v: Any) -> str:
    """A card value in words: dates, names and units, never JSON."""
    if key == "differential_privacy":  # None = no DP, as the Markdown card says
        return dp_description(v)
    if v is None or v == "":
        return "unknown"
    if key == "created_unix_ms":
        return _published(v)
    if key == "training_images" and isinstance(v, dict):
        return _training_images(v)
    if key == "aggregation":
        return _AGGREGATION.get(str(v), str(v))
    if key == "shape" and isinstance(v, list) and len(v) == 2:
        return f"{v[0]:,} features × {v[1]} classes"
    if key == "preprocessing":
        return _preprocessing(str(v))
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list | tuple):
        return ", ".join(str(x) for x in v) or "none"
    if isinstance(v, dict):
        return "; ".join(f"{_label(str(k))}: {_value(str(k), x)}" for k, x in v.items()) or "none"
    return str(v)


def _kv(rows: dict[str, Any]) -> str:
    """A two-column table of labels and values in words (no header row)."""
    cells = "\n".join(
        f'<tr><td class="name">{escape(_label(k))}</td><td>{escape(_value(k, v))}</td></tr>'
        for k, v in rows.items()
    )
    return f'<table class="kv">\n{cells}\n</table>'


def _in_sample(body: dict[str, Any]) -> tuple[bool | None, list[str]]:
    """Whether an evaluation's figures were computed on the training images: ``in_sample`` of the
    evaluation (a site's ``afl-client evaluate``: True/False; a federated evaluation: True/False,
    or per member as `afl export` records from the site's report), with the sites where it is
    in-sample; None when that is not known for every member."""
    flag = body.get("in_sample")
    if not isinstance(flag, dict):
        return (flag if isinstance(flag, bool) else None), []
    inside = sorted(str(site) for site, v in flag.items() if v)
    if inside:
        return True, inside
    members = {str(m) for m in body.get("members") or flag}
    return (False if members <= {str(s) for s in flag} else None), []


def _sample_notice(body: dict[str, Any]) -> str:
    """The in-sample status in words a reader cannot miss."""
    flag, inside = _in_sample(body)
    if flag is True:
        where = f" (at {', '.join(inside)})" if inside else ""
        return (
            '<div class="banner surrogate">IN-SAMPLE FIGURES'
            + escape(where)
            + ": computed on the same images the model was trained on. They are optimistic and "
            "are NOT a measure of how the model performs on new patients.</div>"
        )
    if flag is False:
        return (
            '<p class="note">Out-of-sample: computed on held-out images that were not used for '
            "training.</p>"
        )
    known = body.get("in_sample")
    held = (
        f" Held-out images at {', '.join(sorted(map(str, known)))}; not known for the others."
        if isinstance(known, dict) and known
        else ""
    )
    return (
        '<div class="banner surrogate">NOT SHOWN TO BE OUT-OF-SAMPLE: this evaluation does not '
        "say for every site which images it was computed on. A run's evaluation uses a site's "
        "hold-out only where the site set one ([data] holdout); otherwise its figures are "
        f"in-sample (computed on the training images) and optimistic.{escape(held)}</div>"
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
        out.append(f"<h3>{escape(title[:1].upper() + title[1:])}</h3>")
        out.append(_sample_notice(body))
        notes = [f"{_label(k)}: {body[k]}" for k in ("source", "data") if body.get(k)]
        dp = body.get("dp")
        if isinstance(dp, dict):  # a DP evaluation round (docs/protocol.md §6.1)
            notes.append(
                f"differentially private evaluation: ε = {dp.get('epsilon')}, δ = "
                f"{dp.get('delta')} per site; every count carries noise, so the figures are "
                "estimates"
            )
        images = max((r.get("n_pos", 0) + r.get("n_neg", 0) for r in per_class.values()), default=0)
        if images:
            notes.append(f"at most {images:,} labelled images per class")
        if isinstance(body.get("bootstrap"), dict):
            b = body["bootstrap"]
            level = b.get("confidence")
            level_text = f"{100 * level:g}%" if isinstance(level, float) else str(level)
            notes.append(f"{level_text} intervals from {b.get('resamples')} bootstrap resamples")
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
            marked = title + (" (IN-SAMPLE)" if _in_sample(body)[0] else "")
            out.append(
                f'<img src="{evaluation_plot(per_class, title=marked)}" alt="{escape(marked)}">'
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
    backbone = card.get("backbone") or {}
    banner = (
        '<div class="banner surrogate">' + escape(warnings[0]) + "</div>"
        if training.get("surrogate_features") or backbone.get("trained_on")
        else ""
    )
    if backbone.get("random_init"):
        banner += (
            '<div class="banner surrogate">RANDOM (UNTRAINED) BACKBONE WEIGHTS: the features '
            "carry no learnt image content; every figure below is for testing the deployment "
            "path only.</div>"
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
        _kv(backbone),
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
