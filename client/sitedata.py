"""Site data sources and image readers (docs/method.md §2): what a hospital has on disk → labelled records.

Sources give an ordered list of :class:`ImageRecord` (id, path, labels) over a fixed class list;
labels use the feature-cache convention 1 positive, 0 negative, -1 not labelled (structurally
absent). Readers return a float32 grayscale array in [0, 1]:

* PNG/JPEG (Pillow): divided by the nominal maximum of the bit depth (255 or 65535).
* DICOM (pydicom): stored values v → v·RescaleSlope + RescaleIntercept, mapped linearly from the
  rescaled range of the stored bit depth onto [0, 1] (TorchXRayVision divides by 2^BitsStored − 1),
  MONOCHROME1 inverted (x → 1 − x) so bone is bright as in MONOCHROME2.

A file that cannot be read raises :class:`UnreadableImageError`; the extraction applies the
``skip`` (reported) or ``fail`` policy.
"""

from __future__ import annotations

import csv
import gzip
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

NIH_PAPER_CLASSES = (
    "Atelectasis", "Cardiomegaly", "Effusion", "Infiltration",
    "Mass", "Nodule", "Pneumonia", "Pneumothorax",
)  # fmt: skip
NIH_TOP8_PA_CLASSES = (
    "Atelectasis", "Cardiomegaly", "Effusion", "Infiltration",
    "Mass", "Nodule", "Pleural_Thickening", "Pneumothorax",
)  # fmt: skip
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_TRUE = {"1", "1.0", "true", "yes", "y"}
_FALSE = {"0", "0.0", "false", "no", "n"}
_ABSENT = {"", "-1", "-1.0", "nan", "na", "n/a", "none"}


class SiteDataError(Exception):
    """A data source (folder layout, CSV) is malformed."""


class UnreadableImageError(Exception):
    """An image file is missing, truncated, corrupt or of an unsupported kind."""


@dataclass(frozen=True)
class ImageRecord:
    """One image: ``patient`` is its patient id ("" when the source has none), the DP privacy
    unit (docs/protocol.md §7)."""

    id: str
    path: Path
    labels: tuple[int, ...]
    patient: str = ""


@dataclass(frozen=True)
class SiteSource:
    """An ordered, labelled image list. ``description`` is a human label (not compared)."""

    records: tuple[ImageRecord, ...]
    classes: tuple[str, ...]
    description: str

    @property
    def patients(self) -> tuple[str, ...] | None:
        """Every record's patient id, or None when the source names no patients."""
        ids = tuple(r.patient for r in self.records)
        return ids if ids and all(ids) else None

    @property
    def labels(self) -> NDArray[np.int8]:
        out = np.array([r.labels for r in self.records], dtype=np.int8)
        return out.reshape(len(self.records), len(self.classes))


def _find_nih_csv(root: Path) -> Path:
    found = sorted(root.glob("Data_Entry_2017*.csv")) + sorted(root.glob("Data_Entry_2017*.csv.gz"))
    if not found:
        raise SiteDataError(f"{root}: no Data_Entry_2017*.csv (NIH ChestX-ray14 layout expected)")
    return found[0]


def _index_nih_images(root: Path) -> dict[str, Path]:
    index: dict[str, Path] = {}
    for folder in [
        root / "images",
        *sorted(root.glob("images_*/images")),
        *sorted(root.glob("images_*")),
    ]:
        if folder.is_dir():
            for entry in os.scandir(folder):
                if entry.name.lower().endswith(_IMAGE_SUFFIXES):
                    index.setdefault(entry.name, Path(entry.path))
    return index


def nih_source(
    root: str | os.PathLike[str],
    *,
    classes: Sequence[str] = NIH_PAPER_CLASSES,
    views: Sequence[str] | None = None,
    csv_path: str | os.PathLike[str] | None = None,
) -> SiteSource:
    """NIH ChestX-ray14: ``Data_Entry_2017*.csv`` + ``images/`` or Kaggle ``images_0NN/images/``.

    Every CSV row (optionally only ``views`` such as ``("PA",)``) becomes a record, labelled for
    every class (NIH is fully annotated; "No Finding" = all negative). A row whose file is not on
    disk keeps its expected path and is handled by the unreadable-file policy, never dropped.
    """
    base = Path(root)
    table = Path(csv_path) if csv_path is not None else _find_nih_csv(base)
    images = _index_nih_images(base)
    want_views = {v.upper() for v in views} if views else None
    records = []
    opener = gzip.open if table.suffix == ".gz" else open
    with opener(table, "rt", newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        for col in ("Image Index", "Finding Labels"):
            if col not in (reader.fieldnames or []):
                raise SiteDataError(f"{table}: column {col!r} missing")
        for row in reader:
            view = (row.get("View Position") or "").upper()
            if want_views is not None and view not in want_views:
                continue
            name = row["Image Index"]
            findings = set(row["Finding Labels"].split("|"))
            labels = tuple(int(c in findings) for c in classes)
            path = images.get(name, base / "images" / name)
            records.append(ImageRecord(name, path, labels, (row.get("Patient ID") or "").strip()))
    return SiteSource(tuple(records), tuple(classes), f"nih:{base}")


def _parse_label(raw: str, *, where: str) -> int:
    value = raw.strip().lower()
    if value in _TRUE:
        return 1
    if value in _FALSE:
        return 0
    if value in _ABSENT:
        return -1
    raise SiteDataError(f"{where}: label {raw!r} is not 1/0/true/false or empty (= not labelled)")


def manifest_source(
    manifest: str | os.PathLike[str],
    *,
    classes: Sequence[str] | None = None,
    path_column: str = "path",
    id_column: str | None = None,
    patient_column: str = "patient",
) -> SiteSource:
    """A hospital's own list: CSV with a path column and one column per class.

    Paths are relative to the CSV's folder unless absolute. ``classes`` defaults to every other
    column; a requested class without a column, or an empty cell, is not labelled (-1). A
    ``patient_column`` (default ``patient``), when the CSV has it, gives every row's patient id
    (the DP privacy unit; an empty cell is an error).
    """
    table = Path(manifest)
    with open(table, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        header = list(reader.fieldnames or [])
        if path_column not in header:
            raise SiteDataError(f"{table}: no {path_column!r} column (columns: {header})")
        if id_column is not None and id_column not in header:
            raise SiteDataError(f"{table}: no {id_column!r} column (columns: {header})")
        has_patient = patient_column in header
        names = (
            tuple(classes)
            if classes is not None
            else tuple(c for c in header if c not in (path_column, id_column, patient_column))
        )
        records = []
        for lineno, row in enumerate(reader, start=2):
            rel = (row.get(path_column) or "").strip()
            if not rel:
                raise SiteDataError(f"{table}:{lineno}: empty {path_column!r}")
            path = Path(rel) if Path(rel).is_absolute() else table.parent / rel
            labels = tuple(
                _parse_label(row.get(c) or "", where=f"{table}:{lineno} column {c!r}")
                for c in names
            )
            rid = (row.get(id_column) or "").strip() if id_column else rel
            patient = (row.get(patient_column) or "").strip() if has_patient else ""
            if has_patient and not patient:
                raise SiteDataError(f"{table}:{lineno}: empty {patient_column!r}")
            records.append(ImageRecord(rid, path, labels, patient))
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        raise SiteDataError(f"{table}: duplicate image ids")
    return SiteSource(tuple(records), names, f"manifest:{table}")


def _read_dicom(path: Path) -> NDArray[np.float32]:
    import pydicom

    ds = pydicom.dcmread(path)
    photometric = str(ds.get("PhotometricInterpretation", ""))
    if photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise UnreadableImageError(f"{path}: PhotometricInterpretation {photometric!r} unsupported")
    stored = np.asarray(ds.pixel_array, dtype=np.float64)
    if stored.ndim != 2:
        raise UnreadableImageError(f"{path}: expected one 2-D frame, got shape {stored.shape}")
    bits = int(ds.get("BitsStored", 16))
    signed = int(ds.get("PixelRepresentation", 0)) == 1
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    slope = float(ds.get("RescaleSlope", 1.0) or 1.0)
    intercept = float(ds.get("RescaleIntercept", 0.0) or 0.0)
    ends = sorted((lo * slope + intercept, hi * slope + intercept))
    out = (stored * slope + intercept - ends[0]) / (ends[1] - ends[0])
    if photometric == "MONOCHROME1":
        out = 1.0 - out
    unit: NDArray[np.float32] = np.clip(out, 0.0, 1.0).astype(np.float32)
    return unit


def _read_pillow(path: Path) -> NDArray[np.float32]:
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        if im.mode in ("I;16", "I;16B", "I;16L", "I"):
            arr = np.asarray(im, dtype=np.float64) / 65535.0
        elif im.mode == "F":
            raise UnreadableImageError(f"{path}: floating-point images are not supported")
        else:
            arr = np.asarray(im.convert("L"), dtype=np.float64) / 255.0
    out: NDArray[np.float32] = np.clip(arr, 0.0, 1.0).astype(np.float32)
    return out


def read_image(path: str | os.PathLike[str]) -> NDArray[np.float32]:
    """Decode one image to float32 grayscale (H, W) in [0, 1]; DICOM by magic or suffix."""
    file = Path(path)
    try:
        with open(file, "rb") as fh:
            head = fh.read(132)
        is_dicom = head[128:132] == b"DICM" or file.suffix.lower() in (".dcm", ".dicom")
        arr = _read_dicom(file) if is_dicom else _read_pillow(file)
    except UnreadableImageError:
        raise
    except Exception as exc:  # Pillow/pydicom raise many types for bad files
        raise UnreadableImageError(f"{file}: {type(exc).__name__}: {exc}") from exc
    if arr.ndim != 2 or min(arr.shape) < 1:
        raise UnreadableImageError(f"{file}: not a 2-D grayscale image (shape {arr.shape})")
    return arr
