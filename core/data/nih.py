"""NIH ChestX-ray14 protocol from the metadata torchxrayvision ships (docs/method.md §2).

The metadata is ``Data_Entry_2017_v2020.csv.gz`` (112,120 rows) in torchxrayvision's ``data/``
folder. We locate it *without importing* torchxrayvision (that would import torch) and parse it
with :mod:`csv` + :mod:`gzip` only.

Protocol facts reproduced here (checked in ``tests/core/data/test_nih.py``):

- PA views: 67,310 images of 28,868 patients; all PA images are kept (FedMLP), unlike
  ``xrv.datasets.NIH_Dataset`` whose default keeps one image per patient.
- Image-wise 7:3 split, seed 2023 (FedMLP ``preprocess/split_train_test.py``): sklearn's
  ``train_test_split(test_size=1 - 0.7)`` under ``np.random.seed(2023)``. sklearn takes
  ``n_test = ceil(test_size * n)``; in floating point ``(1 - 0.7) * 67310 = 20193.000000000004``,
  so ``n_test = 20,194`` and ``n_train = 47,116`` -- FedMLP's counts. We use the same legacy
  ``RandomState(seed).permutation(n)`` (test = first ``n_test``, train = the rest, both in
  permutation order), so the split equals sklearn's for the same row order.
- IID partition, seed 1037 (FedMLP ``utils/sampling.py::iid_sampling``): ``int(n / K)`` images
  per client drawn without replacement client after client; 8 x 5,889 = 47,112 of 47,116, the
  remaining 4 images belong to no client (``drop_remainder=True``, FedMLP's behaviour).
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from numpy.typing import NDArray

PAPER_CLASSES: tuple[str, ...] = (
    "Atelectasis",
    "Cardiomegaly",
    "Effusion",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pneumonia",
    "Pneumothorax",
)
"""The paper's 8 classes (Pneumonia at ~0.9% prevalence in PA views, as the paper quotes)."""

TOP8_PA_CLASSES: tuple[str, ...] = (
    "Atelectasis",
    "Cardiomegaly",
    "Effusion",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pleural_Thickening",
    "Pneumothorax",
)
"""The 8 most frequent findings in PA views (Pleural_Thickening replaces Pneumonia)."""

CLASS_SETS: dict[str, tuple[str, ...]] = {"paper": PAPER_CLASSES, "top8-pa": TOP8_PA_CLASSES}

ALL_FINDINGS: tuple[str, ...] = (
    "Atelectasis",
    "Cardiomegaly",
    "Consolidation",
    "Edema",
    "Effusion",
    "Emphysema",
    "Fibrosis",
    "Hernia",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pleural_Thickening",
    "Pneumonia",
    "Pneumothorax",
)
"""The 14 findings of ChestX-ray14 ("No Finding" is the absence of all of them)."""

METADATA_FILENAME = "Data_Entry_2017_v2020.csv.gz"
FEDMLP_SPLIT_SEED = 2023
FEDMLP_PARTITION_SEED = 1037


class NihMetadataError(Exception):
    """The NIH metadata file cannot be found or does not have the expected content."""


@dataclass(frozen=True)
class NihLabels:
    """The label matrix of the selected view: row i is image ``image_ids[i]`` (CSV order)."""

    image_ids: tuple[str, ...]
    patient_ids: NDArray[np.int64]
    labels: NDArray[np.int8]
    classes: tuple[str, ...]

    @property
    def n(self) -> int:
        return len(self.image_ids)

    def prevalence(self) -> NDArray[np.float64]:
        """Fraction of positive images per class."""
        return np.asarray(self.labels.mean(axis=0, dtype=np.float64), dtype=np.float64)


def find_metadata(metadata_path: str | os.PathLike[str] | None = None) -> Path:
    """Return the metadata path: ``metadata_path`` if given, else torchxrayvision's copy."""
    if metadata_path is not None:
        path = Path(metadata_path)
        if not path.is_file():
            raise NihMetadataError(f"NIH metadata file not found: {path}")
        return path
    spec = importlib.util.find_spec("torchxrayvision")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / "data" / METADATA_FILENAME
        if path.is_file():
            return path
    raise NihMetadataError(
        f"cannot find {METADATA_FILENAME}: `pip install torchxrayvision` (it ships the file) "
        "or pass `--metadata PATH` to the CSV (plain or .gz)"
    )


def _open_text(path: Path) -> csv.DictReader[str]:
    raw = path.read_bytes()
    text = gzip.decompress(raw).decode("utf-8") if raw[:2] == b"\x1f\x8b" else raw.decode("utf-8")
    return csv.DictReader(text.splitlines())


def load_pa_labels(
    *,
    classes: Sequence[str] = PAPER_CLASSES,
    metadata_path: str | os.PathLike[str] | None = None,
    view: str = "PA",
) -> NihLabels:
    """Read the metadata and return the 0/1 label matrix of all images of ``view``.

    ``labels[i, c] = 1`` iff ``classes[c]`` appears in image i's ``Finding Labels`` (``|``
    separated). All images of the view are kept (several per patient), in file order.
    """
    cls = tuple(classes)
    unknown = [c for c in cls if c not in ALL_FINDINGS]
    if unknown or not cls or len(set(cls)) != len(cls):
        raise NihMetadataError(
            f"classes must be distinct ChestX-ray14 findings; bad: {unknown or list(cls)}; "
            f"known: {', '.join(ALL_FINDINGS)}"
        )
    path = find_metadata(metadata_path)
    reader = _open_text(path)
    needed = {"Image Index", "Finding Labels", "Patient ID", "View Position"}
    if reader.fieldnames is None or not needed <= set(reader.fieldnames):
        raise NihMetadataError(f"{path}: missing columns {sorted(needed)}")
    col = {c: j for j, c in enumerate(cls)}
    ids: list[str] = []
    patients: list[int] = []
    rows: list[list[int]] = []
    for rec in reader:
        if rec["View Position"] != view:
            continue
        ids.append(rec["Image Index"])
        patients.append(int(rec["Patient ID"]))
        row = [0] * len(cls)
        for finding in rec["Finding Labels"].split("|"):
            j = col.get(finding.strip())
            if j is not None:
                row[j] = 1
        rows.append(row)
    if not ids:
        raise NihMetadataError(f"{path}: no images with View Position == {view!r}")
    labels = np.asarray(rows, dtype=np.int8).reshape(len(ids), len(cls))
    return NihLabels(tuple(ids), np.asarray(patients, dtype=np.int64), labels, cls)


def _n_test(n: int, train_fraction: float) -> int:
    """sklearn's convention: ``n_test = ceil((1 - train_fraction) * n)`` (float arithmetic)."""
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
    n_test = math.ceil((1.0 - train_fraction) * n)
    if n_test < 1 or n_test >= n:
        raise ValueError(f"a {train_fraction} split of {n} rows leaves an empty side")
    return n_test


def split_train_test(
    data: NihLabels | NDArray[np.integer] | int,
    *,
    mode: Literal["image", "patient"] = "image",
    train_fraction: float = 0.7,
    seed: int = FEDMLP_SPLIT_SEED,
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Split row indices into (train, test).

    ``data`` is a :class:`NihLabels`, an array of per-row patient ids, or (image mode only) the
    number of rows.

    - ``image`` (FedMLP): ``p = RandomState(seed).permutation(n)``; test = ``p[:n_test]``,
      train = ``p[n_test:]`` with ``n_test = ceil((1 - train_fraction) n)`` -- identical to
      ``sklearn.model_selection.train_test_split(range(n), test_size=1 - train_fraction,
      random_state=seed)``. Indices are returned in permutation order (FedMLP's train CSV order,
      which :func:`iid_partition` positions refer to). A patient may appear on both sides.
    - ``patient``: the distinct patients are permuted with ``RandomState(seed)``; the train side
      takes whole patients in that order while its image count stays ``<= n - n_test``, the test
      side gets all other patients. No patient is on both sides. Indices are sorted.
    """
    if mode == "image":
        n = data if isinstance(data, int) else len(_patients(data))
        n_test = _n_test(n, train_fraction)
        perm = np.random.RandomState(seed).permutation(n).astype(np.int64)
        return perm[n_test:], perm[:n_test]
    if mode == "patient":
        if isinstance(data, int):
            raise ValueError("a patient-wise split needs patient ids (NihLabels or an array)")
        pids = _patients(data)
        n_train_max = len(pids) - _n_test(len(pids), train_fraction)
        uniq, inverse, counts = np.unique(pids, return_inverse=True, return_counts=True)
        order = np.random.RandomState(seed).permutation(len(uniq))
        n_train_patients = int(np.searchsorted(np.cumsum(counts[order]), n_train_max, "right"))
        is_train_patient = np.zeros(len(uniq), dtype=bool)
        is_train_patient[order[:n_train_patients]] = True
        mask = is_train_patient[inverse]
        if mask.all() or not mask.any():
            raise ValueError("the patient-wise split leaves an empty side")
        return np.flatnonzero(mask).astype(np.int64), np.flatnonzero(~mask).astype(np.int64)
    raise ValueError(f"mode must be 'image' or 'patient', got {mode!r}")


def _patients(data: NihLabels | NDArray[np.integer] | int) -> NDArray[np.int64]:
    if isinstance(data, NihLabels):
        return data.patient_ids
    if isinstance(data, int):
        raise TypeError("expected NihLabels or a patient-id array")
    arr = np.asarray(data)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"patient ids must be a 1-D integer array, got {arr.dtype}{arr.shape}")
    return arr.astype(np.int64)


def iid_partition(
    n: int,
    *,
    num_clients: int = 8,
    seed: int = FEDMLP_PARTITION_SEED,
    drop_remainder: bool = True,
) -> list[NDArray[np.int64]]:
    """IID partition of positions ``0..n-1`` into ``num_clients`` disjoint sorted index arrays.

    Reproduces FedMLP's ``iid_sampling``: ``np.random.seed(seed)``; for each client in turn,
    ``np.random.choice(pool, int(n / K), replace=False)`` from the remaining pool, where the pool
    is rebuilt as ``list(set(pool) - chosen)`` (CPython's deterministic set order for ints).
    The ``n - K * int(n / K)`` left-over positions go to no client with ``drop_remainder``
    (FedMLP: 4 of 47,116), or one each to clients 0, 1, ... otherwise.
    """
    if num_clients < 1 or n < num_clients:
        raise ValueError(f"cannot split {n} rows among {num_clients} clients")
    rng = np.random.RandomState(seed)
    per_client = n // num_clients
    pool: list[int] = list(range(n))
    parts: list[set[int]] = []
    for _ in range(num_clients):
        chosen = {int(v) for v in rng.choice(pool, per_client, replace=False)}
        parts.append(chosen)
        pool = list(set(pool) - chosen)
    if not drop_remainder:
        for k, leftover in enumerate(sorted(pool)):
            parts[k].add(leftover)
    return [np.asarray(sorted(p), dtype=np.int64) for p in parts]
