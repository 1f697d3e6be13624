"""Site data sources and image readers (docs/method.md §2): what a hospital has on disk → labelled records.

Sources give an ordered list of :class:`ImageRecord` (id, path, labels) over a fixed class list;
labels use the feature-cache convention 1 positive, 0 negative, -1 not labelled (structurally
absent). Readers return a float32 grayscale array in [0, 1]:

* PNG/JPEG (Pillow): divided by the nominal maximum of the bit depth (255 or 65535).
* DICOM (pydicom) as radiology viewers show it: the Modality LUT or rescale, then the file's
  first VOI LUT or window (WindowCenter/WindowWidth, VOILUTFunction) when it has one, mapped
  linearly from that step's output range onto [0, 1] (without a VOI: the rescaled range of the
  stored bit depth, as TorchXRayVision divides by 2^BitsStored − 1); MONOCHROME1 inverted
  (x → 1 − x) so bone is bright as in MONOCHROME2. Compressed transfer syntaxes (JPEG Lossless,
  JPEG-LS, JPEG 2000, RLE) decode through the plugins of the ``client`` extra (pylibjpeg,
  pylibjpeg-libjpeg, pylibjpeg-openjpeg); other photometric interpretations are refused with a
  message naming the supported ones.

A file that cannot be read raises :class:`UnreadableImageError`; the extraction applies the
``skip`` (reported) or ``fail`` policy.
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.suggest import did_you_mean, unknown_names

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
    """An ordered, labelled image list. ``description`` is a human label (not compared);
    ``warnings`` are what a person should read before extracting (unused columns...)."""

    records: tuple[ImageRecord, ...]
    classes: tuple[str, ...]
    description: str
    warnings: tuple[str, ...] = ()

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


#: What a -1 in a label column means: ``unlabelled`` (afl's convention, the default) or, in a
#: CheXpert-style file where -1 is "uncertain", the label it becomes.
UNCERTAIN_AS = {"unlabelled": -1, "positive": 1, "negative": 0}
#: Finding names of NIH ChestX-ray14 and CheXpert, for did-you-mean hints on manifest columns.
KNOWN_FINDINGS = (
    "Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Effusion", "Emphysema", "Fibrosis",
    "Hernia", "Infiltration", "Mass", "Nodule", "Pleural_Thickening", "Pneumonia", "Pneumothorax",
    "No Finding", "Enlarged Cardiomediastinum", "Lung Opacity", "Lung Lesion", "Pleural Effusion",
    "Pleural Other", "Fracture", "Support Devices",
)  # fmt: skip


def _parse_label(raw: str, *, where: str, uncertain: int = -1) -> int:
    value = raw.strip().lower()
    if value in _TRUE:
        return 1
    if value in _FALSE:
        return 0
    if value in ("-1", "-1.0"):
        return uncertain
    if value in _ABSENT:
        return -1
    raise SiteDataError(
        f"{where}: label {raw!r} is not 1/0/true/false, -1 or empty (= not labelled); if this "
        "column is not a class, list the class columns with --classes"
    )


def _check_header(table: Path, header: Sequence[str], *, path_column: str) -> None:
    seen: dict[str, int] = {}
    for i, name in enumerate(header, start=1):
        if not name.strip():
            raise SiteDataError(f"{table}: column {i} has no name")
        if name in seen:
            raise SiteDataError(
                f"{table}: column {name!r} appears twice (columns {seen[name]} and {i}); one "
                "of them would be lost"
            )
        seen[name] = i
    if path_column not in seen:
        raise SiteDataError(
            f"{table}: no {path_column!r} column{did_you_mean(path_column, header)} (columns: "
            f"{list(header)}; name the image column with --path-column)"
        )


def manifest_source(
    manifest: str | os.PathLike[str],
    *,
    classes: Sequence[str] | None = None,
    path_column: str = "path",
    id_column: str | None = None,
    uncertain_as: str = "unlabelled",
    patient_column: str = "patient",
) -> SiteSource:
    """A hospital's own list: CSV with a path column and one column per class.

        Paths are relative to the CSV's folder unless absolute. ``classes`` defaults to every other
        column. Refused with the line and the cause: duplicate or unnamed columns, a requested class
        without a column (with a did-you-mean hint), rows longer or shorter than the header, labels
        outside 1/0/true/false/-1/empty, and (when ``classes`` is not given) a column that looks like a
    misspelt finding (``Efusion``: its labels would never reach the federation's Effusion). An empty cell is "not labelled"; -1 is "not labelled" too
        unless ``uncertain_as`` says what an uncertain (CheXpert-style) -1 becomes. The source's
        ``warnings`` name unused columns and declared classes that look like misspelt findings. A
        ``patient_column`` (default ``patient``), when the CSV has it, gives every row's patient id
        (the DP privacy unit; an empty cell is an error).
    """
    table = Path(manifest)
    if uncertain_as not in UNCERTAIN_AS:
        raise SiteDataError(
            f"uncertain_as must be one of {sorted(UNCERTAIN_AS)}, got {uncertain_as!r}"
        )
    uncertain = UNCERTAIN_AS[uncertain_as]
    warnings: list[str] = []
    with open(table, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        header = list(reader.fieldnames or [])
        _check_header(table, header, path_column=path_column)
        if id_column is not None and id_column not in header:
            raise SiteDataError(
                f"{table}: no {id_column!r} column{did_you_mean(id_column, header)} (columns: {header})"
            )
        has_patient = patient_column in header
        others = [c for c in header if c not in (path_column, id_column, patient_column)]
        if classes is not None:
            names = tuple(classes)
            absent = [c for c in names if c not in header]
            if absent:
                raise SiteDataError(
                    f"{table}: requested classes without a column: {unknown_names(absent, others)}"
                    " (list only the classes this site labels; the federation's other classes "
                    "need no column)"
                )
            unused = [c for c in others if c not in names]
            if unused:
                warnings.append(f"{table}: columns not extracted (not in --classes): {unused}")
        else:
            names = tuple(others)
        for column in names:
            hint = did_you_mean(column, KNOWN_FINDINGS)
            if hint and column not in KNOWN_FINDINGS:
                if classes is None:  # taken from the header: a typo would make a new class
                    raise SiteDataError(
                        f"{table}: column {column!r} is not a known finding{hint}: rename the "
                        f"column, or list the classes with --classes to keep {column!r} as a class"
                    )
                warnings.append(f"{table}: column {column!r} is not a known finding{hint}")
        records = []
        for row in reader:
            lineno = reader.line_num
            if None in row:
                raise SiteDataError(
                    f"{table}:{lineno}: {len(header) + len(row[None])} fields, the header has "
                    f"{len(header)} (a comma inside a value? quote it)"
                )
            if any(v is None for v in row.values()):
                count = sum(v is not None for v in row.values())
                raise SiteDataError(
                    f"{table}:{lineno}: {count} fields, the header has {len(header)}"
                )
            rel = (row.get(path_column) or "").strip()
            if not rel:
                raise SiteDataError(f"{table}:{lineno}: empty {path_column!r}")
            path = Path(rel) if Path(rel).is_absolute() else table.parent / rel
            labels = tuple(
                _parse_label(
                    row.get(c) or "", where=f"{table}:{lineno} column {c!r}", uncertain=uncertain
                )
                for c in names
            )
            rid = (row.get(id_column) or "").strip() if id_column else rel
            patient = (row.get(patient_column) or "").strip() if has_patient else ""
            if has_patient and not patient:
                raise SiteDataError(f"{table}:{lineno}: empty {patient_column!r}")
            records.append(ImageRecord(rid, path, labels, patient))
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise SiteDataError(f"{table}: duplicate image id {dup!r}")
    source = SiteSource(tuple(records), names, f"manifest:{table}", tuple(warnings))
    return replace(source, warnings=(*source.warnings, *partial_label_warnings(source)))


def partial_label_warnings(source: SiteSource) -> list[str]:
    """A class labelled in some rows and -1 in others cannot be used by this site (an active
    class must be fully labelled, docs/method.md §1.2): name it, and the -1 conventions."""
    labels = source.labels
    out = []
    for j, name in enumerate(source.classes):
        column = labels[:, j]
        missing = int((column < 0).sum())
        if missing and missing < column.size:
            out.append(
                f"class {name!r}: {missing} of {column.size} rows are -1/empty (not labelled), so "
                "this site cannot use this class; if -1 means 'uncertain' here (CheXpert), "
                "re-run with --uncertain-as positive|negative"
            )
    return out


def missing_files(source: SiteSource) -> list[ImageRecord]:
    """Records whose image file is not on disk (checked before any work starts)."""
    return [r for r in source.records if not r.path.is_file()]


#: Photometric interpretations afl reads (grayscale radiographs).
DICOM_PHOTOMETRIC = ("MONOCHROME1", "MONOCHROME2")
#: The pydicom plugins for compressed transfer syntaxes (module, package; the ``client`` extra).
_DECODERS = (
    ("pylibjpeg", "pylibjpeg"),
    ("libjpeg", "pylibjpeg-libjpeg"),
    ("openjpeg", "pylibjpeg-openjpeg"),
)


def _lut_range(descriptor: Sequence[int]) -> tuple[float, float]:
    """Output range of a Modality or VOI LUT: 0 .. 2^bits − 1 (LUTDescriptor[2], PS3.3 C.11)."""
    return 0.0, float(2 ** int(descriptor[2]) - 1)


def _modality_range(ds: Any) -> tuple[float, float]:
    """Range of the modality values (after the Modality LUT / rescale) of the stored bit depth,
    as pydicom's windowing defines it (PS3.3 C.11.1.1.1)."""
    if ds.get("ModalityLUTSequence"):
        return _lut_range(ds.ModalityLUTSequence[0].LUTDescriptor)
    bits = int(ds.get("BitsStored", 16))
    signed = int(ds.get("PixelRepresentation", 0)) == 1
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    slope = float(ds.get("RescaleSlope", 1.0) or 1.0)
    intercept = float(ds.get("RescaleIntercept", 0.0) or 0.0)
    ends = sorted((lo * slope + intercept, hi * slope + intercept))
    return ends[0], ends[1]


def _voi_table(
    values: NDArray[np.float64], ds: Any, path: Path
) -> tuple[NDArray[np.float64], tuple[float, float]]:
    """The first VOI LUT of the file (PS3.3 C.11.2.1.1): entry ``v − first`` clipped to the
    table, for integer modality values v. (pydicom's ``apply_voi`` indexes an 8-bit table with
    uint8 and wraps above 255 entries, so the lookup is done here.)"""
    item = ds.VOILUTSequence[0]
    entries, first, _ = (int(v) for v in item.LUTDescriptor)
    entries = entries or 65536
    raw = item.LUTData
    if isinstance(raw, bytes):  # VR OW
        little = getattr(ds, "original_encoding", (None, True))[1] is not False
        table = np.frombuffer(raw, dtype="<u2" if little else ">u2").astype(np.float64)
    else:  # VR US: one value or a list
        table = np.atleast_1d(np.asarray(raw, dtype=np.float64))
    if table.size < entries:
        raise UnreadableImageError(
            f"{path}: VOI LUT has {table.size} entries, its descriptor says {entries}"
        )
    index = np.clip(np.rint(values).astype(np.int64) - first, 0, entries - 1)
    return table[index], _lut_range(item.LUTDescriptor)


def _dicom_pixels(ds: Any, path: Path) -> NDArray[Any]:
    try:
        return np.asarray(ds.pixel_array)
    except Exception as exc:  # pydicom raises RuntimeError/NotImplementedError/ValueError...
        meta = getattr(ds, "file_meta", None)
        syntax = meta.get("TransferSyntaxUID") if meta is not None else None
        name = getattr(syntax, "name", str(syntax))
        cause = " ".join(str(exc).split())  # pydicom lists each plugin's error on its own line
        if syntax is not None and getattr(syntax, "is_compressed", False):
            missing = [pkg for module, pkg in _DECODERS if importlib.util.find_spec(module) is None]
            if missing:
                raise UnreadableImageError(
                    f"{path}: cannot decode transfer syntax {name!r}: the decoders "
                    f"{', '.join(missing)} are not installed; `pip install 'afl[client]'` "
                    f"installs them ({cause})"
                ) from exc
            raise UnreadableImageError(
                f"{path}: the installed decoders cannot decode its {name!r} data (the file's "
                "compressed stream is damaged or a variant they do not handle); re-export it "
                "from the PACS uncompressed or as JPEG 2000, JPEG-LS or RLE (supported "
                f"syntaxes: docs/operations.md §5) ({cause})"
            ) from exc
        raise UnreadableImageError(f"{path}: cannot decode the pixel data ({cause})") from exc


def _read_dicom(path: Path) -> NDArray[np.float32]:
    """Grayscale as a radiology viewer shows it (PS3.3 C.11, PS3.4 N.2): stored values → Modality
    LUT or rescale (``apply_modality_lut``) → the first VOI LUT (:func:`_voi_table`) or else the
    first window (``apply_windowing``: LINEAR, LINEAR_EXACT, SIGMOID), when the file has one →
    [0, 1] over the output range of that last step → MONOCHROME1 inverted."""
    import pydicom
    from pydicom.pixels.processing import apply_modality_lut, apply_windowing

    ds = pydicom.dcmread(path)
    if "PixelData" not in ds and "FloatPixelData" not in ds and "DoubleFloatPixelData" not in ds:
        kind = getattr(ds.get("SOPClassUID"), "name", "") or str(ds.get("Modality", ""))
        if not kind:  # nothing says what it is: cut short or not a DICOM file at all
            raise UnreadableImageError(
                f"{path}: no image in this file (no pixel data and no SOP class: damaged, or not "
                "a DICOM image)"
            )
        raise UnreadableImageError(
            f"{path}: no image in this file (a {kind} object without pixel data, such as a "
            "Structured Report): list only image files in the manifest"
        )
    photometric = str(ds.get("PhotometricInterpretation", ""))
    if photometric not in DICOM_PHOTOMETRIC:
        raise UnreadableImageError(
            f"{path}: PhotometricInterpretation {photometric!r} is not supported; afl reads "
            f"grayscale radiographs ({' or '.join(DICOM_PHOTOMETRIC)}): convert colour images "
            "(RGB, YBR_*, PALETTE COLOR) to grayscale first"
        )
    stored = _dicom_pixels(ds, path)
    if stored.ndim != 2:
        raise UnreadableImageError(
            f"{path}: expected one 2-D frame, got shape {stored.shape} (multi-frame files are "
            "not supported)"
        )
    values = np.asarray(apply_modality_lut(stored, ds), dtype=np.float64)
    lo, hi = _modality_range(ds)
    if ds.get("VOILUTSequence"):
        values, (lo, hi) = _voi_table(values, ds, path)
    elif "WindowCenter" in ds and "WindowWidth" in ds:  # VOILUTFunction: pydicom's windowing
        values = np.asarray(apply_windowing(values, ds, index=0), dtype=np.float64)
    if hi <= lo:
        raise UnreadableImageError(f"{path}: empty output range [{lo}, {hi}]")
    out = (values - lo) / (hi - lo)
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
