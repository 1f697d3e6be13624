"""``afl-client predict``: per-class probabilities and decisions for new images from an exported
classifier (docs/operations.md §14).

Images are read with the extraction's own readers (:func:`afl.client.features.sitedata.read_image`:
PNG/JPEG/DICOM), one at a time (each keeps its own size), and run through the exported TorchScript
module (:func:`afl.client.model.export.load_exported`), which holds the preprocessing, the backbone and
the head. Per image and class the output holds

* ``p_<class>``: σ(z), the paper's score, and ``decision_<class>``: 1 when σ(z) > the model's
  decision threshold (0.5), the paper's rule and the only decision rule;
* with a calibration file fitted for this model (:class:`afl.core.evaluation.calibration.Calibration`),
  ``calibrated_<class>``: the calibrated probability, an addition labelled as such.

An unreadable file is reported (one line on stderr naming the file and the cause) and skipped;
the list is written next to the output as ``<output>.unreadable.csv``.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np
from tqdm import tqdm

from afl.client.features.sitedata import UnreadableImageError, manifest_source, read_image
from afl.client.model.export import ExportedModel
from afl.core.evaluation.calibration import Calibration

__all__ = ["Prediction", "PredictionRun", "image_records", "predict_images", "write_predictions"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".dcm", ".dicom")


@dataclass(frozen=True)
class Prediction:
    id: str
    path: str
    probabilities: tuple[float, ...]
    decisions: tuple[int, ...]
    calibrated: tuple[float, ...] | None = None


@dataclass
class PredictionRun:
    classes: tuple[str, ...]
    model_sha256: str
    threshold: float
    calibration: str | None
    rows: list[Prediction] = field(default_factory=list)
    unreadable: list[tuple[str, str, str]] = field(default_factory=list)  # id, path, error


def image_records(
    *,
    images: str | os.PathLike[str] | None = None,
    manifest: str | os.PathLike[str] | None = None,
    path_column: str = "path",
    id_column: str | None = None,
) -> list[tuple[str, Path]]:
    """(id, path) of every image file under ``images`` (recursively, sorted; the id is the path
    relative to the folder) or of every row of a manifest CSV (labels are ignored)."""
    if (images is None) == (manifest is None):
        raise ValueError("give either an image folder or a manifest")
    if manifest is not None:
        source = manifest_source(manifest, classes=(), path_column=path_column, id_column=id_column)
        return [(r.id, r.path) for r in source.records]
    root = Path(images)  # type: ignore[arg-type]
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    found = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    return [(str(p.relative_to(root)), p) for p in found]


def predict_images(
    model: ExportedModel,
    records: Sequence[tuple[str, Path]],
    *,
    calibration: Calibration | None = None,
    progress: bool = True,
    errors: TextIO | Literal["stderr"] | None = "stderr",
) -> PredictionRun:
    """Run the exported classifier on every image (module docstring)."""
    if calibration is not None:
        calibration.check_model(model.model_sha256, model.classes)
    run = PredictionRun(
        model.classes,
        model.model_sha256,
        model.threshold,
        None if calibration is None else calibration.method,
    )
    for image_id, path in tqdm(records, unit="img", disable=not progress):
        try:
            image = read_image(path)
        except UnreadableImageError as exc:
            run.unreadable.append((image_id, str(path), str(exc)))
            if errors is not None:  # "stderr": the stream of the moment, not of the import
                stream = sys.stderr if errors == "stderr" else errors
                print(f"afl-client predict: skipped unreadable image: {exc}", file=stream)
            continue
        probs, logits = model(image)
        calibrated = None
        if calibration is not None:
            calibrated = tuple(float(v) for v in calibration.probabilities(logits[None])[0])
        run.rows.append(
            Prediction(
                image_id,
                str(path),
                tuple(float(p) for p in probs),
                tuple(int(p > model.threshold) for p in probs),
                calibrated,
            )
        )
    return run


def _row(pred: Prediction) -> list[Any]:
    out: list[Any] = [pred.id, pred.path, *pred.probabilities, *pred.decisions]
    if pred.calibrated is not None:
        out += list(pred.calibrated)
    return out


def write_predictions(
    run: PredictionRun, out: str | os.PathLike[str], *, fmt: Literal["csv", "json"] = "csv"
) -> list[Path]:
    """Write the predictions (CSV or JSON) and, when some images were unreadable, the list of
    them as ``<out>.unreadable.csv``; returns the files written."""
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "json":
        doc = {
            "model_sha256": run.model_sha256,
            "classes": list(run.classes),
            "decision_threshold": run.threshold,
            "decision_rule": "decision = 1 when the probability σ(z) > the threshold",
            "calibration": run.calibration,
            "calibrated_note": "calibrated probabilities are an addition; decisions use σ(z)"
            if run.calibration
            else None,
            "predictions": [
                {
                    "id": p.id,
                    "path": p.path,
                    "probability": dict(zip(run.classes, p.probabilities, strict=True)),
                    "decision": dict(zip(run.classes, p.decisions, strict=True)),
                    **(
                        {
                            "calibrated_probability": dict(
                                zip(run.classes, p.calibrated, strict=True)
                            )
                        }
                        if p.calibrated is not None
                        else {}
                    ),
                }
                for p in run.rows
            ],
            "unreadable": [{"id": i, "path": p, "error": e} for i, p, e in run.unreadable],
        }
        target.write_text(json.dumps(doc, indent=2), encoding="utf-8")
    else:
        header = ["id", "path"]
        header += [f"p_{c}" for c in run.classes] + [f"decision_{c}" for c in run.classes]
        if run.calibration:
            header += [f"calibrated_{c}" for c in run.classes]
        with open(target, "w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(header)
            writer.writerows(_row(p) for p in run.rows)
    written = [target]
    if run.unreadable:
        bad = target.with_name(target.name + ".unreadable.csv")
        with open(bad, "w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(["id", "path", "error"])
            writer.writerows(run.unreadable)
        written.append(bad)
    return written


def summary(run: PredictionRun) -> str:
    """One line for the terminal."""
    rows = np.array([p.decisions for p in run.rows]) if run.rows else np.zeros((0, 0))
    positives = (
        ", ".join(f"{c} {int(n)}" for c, n in zip(run.classes, rows.sum(axis=0), strict=True))
        if run.rows
        else "none"
    )
    return (
        f"{len(run.rows)} images predicted, {len(run.unreadable)} unreadable; positive decisions "
        f"(σ(z) > {run.threshold}): {positives}"
    )
