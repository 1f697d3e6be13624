"""The model card of an exported classifier (docs/operations.md §14): what the model is, how it was
trained, how it performed, and what it must not be used for, as JSON and Markdown.

The card states only what the exporting party knows: a site knows its own training images and
the plan it accepted (from its round report), the coordinator knows the signed plan of the round
(from its state) but not how many images the sites hold (no release of a non-DP round counts
rows). Unknown facts are written as unknown, never guessed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FORMAT",
    "TrainingFacts",
    "card_markdown",
    "dp_description",
    "limitations",
    "model_card",
]

FORMAT = "afl-model-card"


@dataclass(frozen=True)
class TrainingFacts:
    """What the exporting party knows about the round that produced the model."""

    source: str  # where the facts come from, e.g. "site report reports/<round>.json"
    aggregation: str | None = None  # e.g. "mask"
    gram_scope: str | None = None
    participants: tuple[str, ...] = ()
    dp: Mapping[str, Any] | None = None  # {"epsilon", "delta", "per_site": {...}} when DP
    training_images: Mapping[str, int] = field(default_factory=dict)  # site -> rows it knows
    surrogate: bool = False  # the training features were surrogate (the demo)


def limitations(*, surrogate: bool, backbone_override: str | None) -> list[str]:
    """What the model must not be used for (always the general list, plus what applies)."""
    out = [
        "Not a medical device: not for diagnosis, triage or treatment decisions without a "
        "clinical validation of this exported model on the deploying site's own population.",
        "Only for frontal (PA) chest X-rays preprocessed exactly as embedded in the model; not "
        "for other views, modalities, body parts or paediatric images unless validated.",
        "Only the listed classes: a low score is not evidence that any other finding is absent.",
        "The 'probabilities' output is σ(z) of the balanced ridge head: it ranks images but is "
        "close to 0.5 for every image and is not a frequency; use a calibration fitted for this "
        "model when a probability is needed. The decision rule is σ(z) > 0.5 (the paper's).",
        "Not for re-identification or for inferring the contributing hospitals' data.",
    ]
    if surrogate:
        out.insert(
            0,
            "TRAINED ON SURROGATE FEATURES (synthetic stand-ins, the embedded demo default): the "
            "outputs mean nothing clinically. For testing the deployment path only.",
        )
    if backbone_override:
        out.insert(
            0,
            f"The model was trained on features from {backbone_override!r}; this export pairs "
            "its head with another backbone. Its outputs are meaningless except for testing.",
        )
    return out


def model_card(
    *,
    model: Mapping[str, Any],
    classes: Sequence[str],
    facts: TrainingFacts,
    backbone: Mapping[str, Any],
    files: Mapping[str, str],
    metrics: Mapping[str, Any] | None = None,
    calibration: Mapping[str, Any] | None = None,
    software_version: str = "",
) -> dict[str, Any]:
    """The card as a JSON-serialisable dict (``model``: ids, digests, contributors...)."""
    known = dict(facts.training_images)
    return {
        "format": FORMAT,
        "version": 1,
        "classes": list(classes),
        "model": {**model, "number_of_sites": len(model.get("contributors", ()))},
        "training": {
            "facts_from": facts.source,
            "aggregation": facts.aggregation,
            "gram_scope": facts.gram_scope,
            "participants": list(facts.participants),
            "differential_privacy": dict(facts.dp) if facts.dp else None,
            "training_images": {
                "known": known,
                "total": sum(known.values())
                if known and set(known) >= set(model.get("contributors", ()))
                else None,
                "note": "rows of the sites named here; the coordinator does not learn row counts",
            },
            "surrogate_features": facts.surrogate,
        },
        "backbone": dict(backbone),
        "inputs": {
            "image": "float32 tensor (batch, 1, height, width): grayscale in [0, 1] as the "
            "afl-client readers give (PNG/JPEG: value / max of the bit depth; DICOM: rescaled "
            "stored range, MONOCHROME1 inverted); one size per batch",
        },
        "outputs": {
            "probabilities": "float64 (batch, classes): σ(z), the paper's score (not calibrated)",
            "logits": "float64 (batch, classes): z = features · W, the head's raw score",
        },
        "decision_rule": f"class positive when σ(z) > {model.get('decision_threshold', 0.5)}",
        "metrics": dict(metrics or {}),
        "calibration": dict(calibration) if calibration else None,
        "must_not_be_used_for": limitations(
            surrogate=facts.surrogate, backbone_override=backbone.get("trained_on")
        ),
        "files": dict(files),
        "software_version": software_version,
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "unknown"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value) or "none"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def dp_description(dp: Mapping[str, Any] | None) -> str:
    """The card's ``training.differential_privacy`` in words, the same wherever it is shown
    (the Markdown card, `afl report`'s deployed view)."""
    if not dp:
        return "none (no differential privacy)"
    return f"ε = {_fmt(dp.get('epsilon'))}, δ = {_fmt(dp.get('delta'))} per site (round)"


def _metrics_md(metrics: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    for title, body in metrics.items():
        per_class = body.get("per_class") if isinstance(body, Mapping) else None
        if not isinstance(per_class, Mapping):
            continue
        lines += ["", f"### {title}", ""]
        source = body.get("source")
        if source:
            lines += [f"Source: {source}", ""]
        flag = body.get("in_sample")
        if flag is True or (isinstance(flag, Mapping) and any(flag.values())):
            lines += [
                "**IN-SAMPLE: computed on the images the model was trained on (optimistic; not "
                "a measure of performance on new patients).**",
                "",
            ]
        lines += ["| class | BACC | AUC | AP |", "|---|---|---|---|"]
        for name, row in per_class.items():
            cells = []
            for key in ("bacc", "auc", "ap"):
                v = row.get(key)
                if isinstance(v, Mapping):  # local evaluation: estimate and interval
                    est, lo, hi = v.get("estimate"), v.get("low"), v.get("high")
                    cells.append("n/a" if est is None else f"{est:.4f} [{_fmt(lo)}, {_fmt(hi)}]")
                else:
                    cells.append("n/a" if v is None else f"{v:.4f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def card_markdown(card: Mapping[str, Any]) -> str:
    """The card as Markdown (the same facts as the JSON)."""
    m, t, b = card["model"], card["training"], card["backbone"]
    lines = [
        f"# Model card: {', '.join(card['classes'])}",
        "",
        "## Must not be used for",
        "",
        *[f"- {item}" for item in card["must_not_be_used_for"]],
        "",
        "## Model",
        "",
        "| field | value |",
        "|---|---|",
    ]
    for key in (
        "federation_id",
        "round_id",
        "round_number",
        "model_sha256",
        "plan_sha256",
        "created_unix_ms",
        "gamma",
        "decision_threshold",
        "number_of_sites",
        "contributors",
    ):
        lines.append(f"| {key} | {_fmt(m.get(key))} |")
    lines += ["", "## Training", "", "| field | value |", "|---|---|"]
    dp_text = dp_description(t.get("differential_privacy"))
    images = t["training_images"]
    lines += [
        f"| facts from | {_fmt(t.get('facts_from'))} |",
        f"| aggregation | {_fmt(t.get('aggregation'))} |",
        f"| gram scope | {_fmt(t.get('gram_scope'))} |",
        f"| participants | {_fmt(t.get('participants'))} |",
        f"| differential privacy | {dp_text} |",
        f"| training images | total {_fmt(images.get('total'))}; known: "
        f"{_fmt(images.get('known')) if images.get('known') else 'none'} |",
        f"| surrogate features | {t.get('surrogate_features')} |",
        "",
        "## Backbone and preprocessing",
        "",
        "| field | value |",
        "|---|---|",
        *[f"| {k} | {_fmt(v)} |" for k, v in b.items()],
        "",
        "## Inputs and outputs",
        "",
        f"- input `image`: {card['inputs']['image']}",
        *[f"- output `{k}`: {v}" for k, v in card["outputs"].items()],
        f"- decision rule: {card['decision_rule']}",
        "",
        "## Metrics",
    ]
    metric_lines = _metrics_md(card.get("metrics") or {})
    lines += metric_lines or ["", "No evaluation was supplied to the export."]
    cal = card.get("calibration")
    lines += ["", "## Calibration", ""]
    lines.append(
        "none: the probabilities output is σ(z), not calibrated"
        if not cal
        else f"{_fmt(cal.get('method'))} (file {_fmt(cal.get('file'))}); an addition, the "
        "decision rule is unchanged"
    )
    lines += ["", "## Files", "", *[f"- {k}: `{v}`" for k, v in card["files"].items()]]
    return "\n".join(lines) + "\n"
