"""On-disk feature cache: the one format for real (backbone) and surrogate features.

A cache is a directory::

    meta.json      format, version, n, d, classes, source, surrogate flag, random_init flag, extra
    ids.txt        one image id per row (UTF-8, newline separated)
    patients.txt   optional: one patient id per row (the DP privacy unit, docs/protocol.md §7);
                   caches written without patient ids have none (``FeatureCache.patients`` None)
    labels.npy     int8 (n, C): 1 positive, 0 negative, -1 not labelled (structurally absent)
    features.npy   float32 (n, d), written incrementally through a memory map
    progress.json  {"rows_done": k}: rows [0, k) are on disk (flushed) and final

Writers pre-allocate ``features.npy`` and commit progress atomically (write + fsync + rename)
after each block, so a crash loses at most the block in flight and a writer re-opened on the
same directory resumes at ``rows_done`` (docs/architecture.md §8: a crash never repeats hours of
extraction). Features are stored as float32 (the backbones' output precision); all statistics are
computed in float64 by the readers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

_T = TypeVar("_T")

FORMAT = "afl-feature-cache"
VERSION = 1
LABEL_POSITIVE = 1
LABEL_NEGATIVE = 0
LABEL_ABSENT = -1


class FeatureCacheError(Exception):
    """A cache directory is missing, malformed, incomplete or inconsistent."""


@dataclass(frozen=True)
class CacheMeta:
    """What a cache holds and where its features came from (stamped into every result)."""

    n: int
    d: int
    classes: tuple[str, ...]
    source: str
    surrogate: bool = False
    random_init: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["classes"] = list(self.classes)
        return {"format": FORMAT, "version": VERSION, **out}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CacheMeta:
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise FeatureCacheError(
                f"not an {FORMAT} v{VERSION} cache (format={raw.get('format')!r}, "
                f"version={raw.get('version')!r})"
            )
        return cls(
            n=int(raw["n"]),
            d=int(raw["d"]),
            classes=tuple(raw["classes"]),
            source=str(raw["source"]),
            surrogate=bool(raw.get("surrogate", False)),
            random_init=bool(raw.get("random_init", False)),
            extra=dict(raw.get("extra", {})),
        )

    @property
    def provenance(self) -> str:
        """A one-line label for reports: surrogate and random-init features are always flagged."""
        flags = [
            f for f, on in (("SURROGATE", self.surrogate), ("RANDOM-INIT", self.random_init)) if on
        ]
        return self.source + (f" [{', '.join(flags)}]" if flags else "")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _read_progress(root: Path) -> int:
    try:
        return int(json.loads((root / "progress.json").read_text(encoding="utf-8"))["rows_done"])
    except (OSError, ValueError, KeyError) as exc:
        raise FeatureCacheError(f"{root}: unreadable progress.json ({exc})") from exc


def _check_labels(labels: NDArray[Any], n: int, c: int) -> NDArray[np.int8]:
    arr = np.asarray(labels)
    if arr.shape != (n, c):
        raise FeatureCacheError(f"labels must have shape ({n}, {c}), got {arr.shape}")
    if not np.isin(arr, (LABEL_ABSENT, LABEL_NEGATIVE, LABEL_POSITIVE)).all():
        raise FeatureCacheError("labels must be -1 (absent), 0 (negative) or 1 (positive)")
    return arr.astype(np.int8)


def _check_patients(patients: Sequence[str], n: int) -> tuple[str, ...]:
    out = tuple(str(p) for p in patients)
    if len(out) != n:
        raise FeatureCacheError(f"{len(out)} patient ids for n={n} rows")
    if any(not p or "\n" in p or p != p.strip() for p in out):
        raise FeatureCacheError("patient ids must be non-empty single-line strings")
    return out


class FeatureCacheWriter:
    """Incremental, resumable writer. Rows must be written in order, block by block."""

    def __init__(self, root: Path, meta: CacheMeta, features: np.memmap[Any, Any], rows_done: int):
        self.root = root
        self.meta = meta
        self._features = features
        self.rows_done = rows_done

    @classmethod
    def create_or_resume(
        cls,
        root: str | os.PathLike[str],
        *,
        meta: CacheMeta,
        ids: Sequence[str],
        labels: NDArray[Any],
        patients: Sequence[str] | None = None,
    ) -> FeatureCacheWriter:
        """Start a new cache, or resume one whose meta, ids, patients and labels match exactly."""
        path = Path(root)
        if len(ids) != meta.n:
            raise FeatureCacheError(f"{len(ids)} ids for n={meta.n} rows")
        lab = _check_labels(labels, meta.n, len(meta.classes))
        patient_ids = None if patients is None else _check_patients(patients, meta.n)
        if (path / "meta.json").exists():
            existing = open_cache(path, allow_partial=True)
            same = existing.meta == meta and existing.ids == tuple(ids)
            if not same or existing.patients != patient_ids:
                raise FeatureCacheError(
                    f"{path} holds a different cache (meta or image list differ); "
                    "remove it or choose another directory"
                )
            if not np.array_equal(existing.labels, lab):
                raise FeatureCacheError(f"{path}: labels differ from the cache being resumed")
            mm = np.lib.format.open_memmap(path / "features.npy", mode="r+")
            return cls(path, meta, mm, existing.rows_done)
        path.mkdir(parents=True, exist_ok=True)
        (path / "ids.txt").write_text("\n".join(ids) + ("\n" if ids else ""), encoding="utf-8")
        if patient_ids is not None:
            text = "\n".join(patient_ids) + ("\n" if patient_ids else "")
            (path / "patients.txt").write_text(text, encoding="utf-8")
        np.save(path / "labels.npy", lab)
        mm = np.lib.format.open_memmap(
            path / "features.npy", mode="w+", dtype=np.float32, shape=(meta.n, meta.d)
        )
        _write_atomic(path / "progress.json", json.dumps({"rows_done": 0}))
        # meta.json last: its presence marks a well-formed cache directory.
        _write_atomic(path / "meta.json", json.dumps(meta.to_json(), indent=2, sort_keys=True))
        return cls(path, meta, mm, 0)

    @property
    def complete(self) -> bool:
        return self.rows_done == self.meta.n

    def write_rows(self, start: int, block: NDArray[Any]) -> None:
        """Write rows [start, start+len(block)) and commit them durably."""
        if start != self.rows_done:
            raise FeatureCacheError(
                f"rows must be written in order: expected {self.rows_done}, got {start}"
            )
        arr = np.asarray(block)
        if arr.ndim != 2 or arr.shape[1] != self.meta.d:
            raise FeatureCacheError(f"feature block must be (rows, {self.meta.d}), got {arr.shape}")
        end = start + arr.shape[0]
        if end > self.meta.n:
            raise FeatureCacheError(f"block ends at row {end} past n={self.meta.n}")
        if not np.isfinite(arr).all():
            raise FeatureCacheError(f"non-finite features in rows [{start}, {end})")
        self._features[start:end] = arr.astype(np.float32, copy=False)
        self._features.flush()
        _write_atomic(self.root / "progress.json", json.dumps({"rows_done": end}))
        self.rows_done = end


@dataclass(frozen=True)
class FeatureCache:
    """A cache opened for reading. ``features`` is a read-only float32 memory map;
    ``patients`` the per-row patient ids (None for a cache written without them)."""

    root: Path
    meta: CacheMeta
    ids: tuple[str, ...]
    labels: NDArray[np.int8]
    features: NDArray[np.float32]
    rows_done: int
    patients: tuple[str, ...] | None = None

    @property
    def complete(self) -> bool:
        return self.rows_done == self.meta.n


def _read_part(file: Path, read: Callable[[Path], _T]) -> _T:
    """One file of a cache, or a one-line error naming it and the fix (a truncated copy gives
    numpy's "mmap length is greater than file size")."""
    try:
        return read(file)
    except FileNotFoundError as exc:
        raise FeatureCacheError(
            f"{file} is missing: the cache is incomplete; delete {file.parent} and run "
            "`afl-client extract` again"
        ) from exc
    except (OSError, ValueError, EOFError) as exc:
        raise FeatureCacheError(
            f"{file} is damaged ({exc}; a copy cut short?): delete {file.parent} and run "
            "`afl-client extract` again, or copy the cache again"
        ) from exc


def open_cache(root: str | os.PathLike[str], *, allow_partial: bool = False) -> FeatureCache:
    """Open a cache; refuse an incomplete one unless ``allow_partial``."""
    path = Path(root)
    try:
        meta = CacheMeta.from_json(json.loads((path / "meta.json").read_text(encoding="utf-8")))
    except FileNotFoundError as exc:
        raise FeatureCacheError(f"{path} is not a feature cache (no meta.json)") from exc
    except (ValueError, KeyError) as exc:
        raise FeatureCacheError(f"{path}/meta.json is malformed ({exc})") from exc
    ids = tuple(_read_part(path / "ids.txt", lambda f: f.read_text(encoding="utf-8")).splitlines())
    labels = _read_part(path / "labels.npy", np.load)
    features = _read_part(path / "features.npy", lambda f: np.load(f, mmap_mode="r"))
    if len(ids) != meta.n or labels.shape != (meta.n, len(meta.classes)):
        raise FeatureCacheError(f"{path}: ids/labels do not match n={meta.n}")
    if features.shape != (meta.n, meta.d) or features.dtype != np.float32:
        raise FeatureCacheError(f"{path}: features.npy is {features.dtype}{features.shape}")
    patients = None
    if (path / "patients.txt").exists():
        text = (path / "patients.txt").read_text(encoding="utf-8")
        patients = tuple(text.splitlines())
        if len(patients) != meta.n:
            raise FeatureCacheError(f"{path}: patients.txt does not match n={meta.n}")
    done = _read_progress(path)
    if not 0 <= done <= meta.n:
        raise FeatureCacheError(f"{path}: progress {done} outside [0, {meta.n}]")
    if done < meta.n and not allow_partial:
        raise FeatureCacheError(
            f"{path}: incomplete cache ({done}/{meta.n} rows); resume the extraction first"
        )
    return FeatureCache(path, meta, ids, labels, features, done, patients)


def write_cache(
    root: str | os.PathLike[str],
    *,
    meta: CacheMeta,
    ids: Sequence[str],
    labels: NDArray[Any],
    features: NDArray[Any],
    patients: Sequence[str] | None = None,
) -> FeatureCache:
    """Write a whole cache in one go (surrogate data, merges). Returns it opened."""
    writer = FeatureCacheWriter.create_or_resume(
        root, meta=meta, ids=ids, labels=labels, patients=patients
    )
    if writer.rows_done:
        raise FeatureCacheError(f"{root} already holds {writer.rows_done} rows")
    step = 8192
    for start in range(0, meta.n, step):
        writer.write_rows(start, np.asarray(features[start : start + step]))
    return open_cache(root)
