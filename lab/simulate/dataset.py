"""A federation's data for in-process runs: per-site training rows and a shared test set.

Two sources, one shape:
- the embedded default: the REAL NIH ChestX-ray14 PA label matrix (from the metadata
  torchxrayvision ships) with SURROGATE features (docs/method.md §2), split 7:3 and partitioned IID
  into K sites as in FedMLP;
- feature caches (``afl.core.data.featurecache``) written by ``afl-client extract`` or by
  ``save_dataset``: one per site plus a test cache.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from afl.core.data import nih, surrogate
from afl.core.data.featurecache import CacheMeta, FeatureCacheError, open_cache, write_cache


@dataclass(frozen=True)
class FederatedDataset:
    """Features are float32 (possibly memory-mapped); labels are complete 0/1 ground truth;
    ``site_patients`` each site's per-row patient ids (None when the source has none)."""

    classes: tuple[str, ...]
    site_names: tuple[str, ...]
    site_features: tuple[NDArray[np.float32], ...]
    site_labels: tuple[NDArray[np.int8], ...]
    test_features: NDArray[np.float32]
    test_labels: NDArray[np.int8]
    provenance: str
    surrogate: bool
    info: dict[str, Any] = field(default_factory=dict)
    site_patients: tuple[NDArray[np.str_], ...] | None = None

    @property
    def num_sites(self) -> int:
        return len(self.site_names)

    @property
    def d(self) -> int:
        return int(self.test_features.shape[1])

    def describe(self) -> dict[str, Any]:
        return {
            "provenance": self.provenance,
            "surrogate": self.surrogate,
            "classes": list(self.classes),
            "sites": {
                name: int(f.shape[0])
                for name, f in zip(self.site_names, self.site_features, strict=True)
            },
            "n_test": int(self.test_features.shape[0]),
            "d": self.d,
            **self.info,
        }


def default_dataset(
    *,
    class_set: str = "paper",
    split: Literal["image", "patient"] = "image",
    num_sites: int = 8,
    d: int = 1024,
    surrogate_seed: int = 0,
    split_seed: int = nih.FEDMLP_SPLIT_SEED,
    partition_seed: int = nih.FEDMLP_PARTITION_SEED,
    metadata_path: str | os.PathLike[str] | None = None,
) -> FederatedDataset:
    """The embedded default: real NIH PA labels, surrogate features, FedMLP's split and partition."""
    if class_set not in nih.CLASS_SETS:
        raise ValueError(f"unknown class set {class_set!r}; choose one of {sorted(nih.CLASS_SETS)}")
    data = nih.load_pa_labels(classes=nih.CLASS_SETS[class_set], metadata_path=metadata_path)
    train, test = nih.split_train_test(data, mode=split, seed=split_seed)
    parts = nih.iid_partition(len(train), num_clients=num_sites, seed=partition_seed)
    # Each training row's site drives the surrogate's non-IID shift; test rows are spread over
    # the same sites (a test set pooled from the participating hospitals).
    site = np.zeros(data.n, dtype=np.int64)
    for k, part in enumerate(parts):
        site[train[part]] = k
    site[test] = np.arange(len(test)) % num_sites
    rows_used = np.concatenate([train[p] for p in parts] + [test])
    features = np.zeros((data.n, d), dtype=np.float32)
    features[rows_used] = surrogate.surrogate_features(
        labels=data.labels[rows_used], site=site[rows_used], d=d, seed=surrogate_seed
    )
    return FederatedDataset(
        classes=data.classes,
        site_names=tuple(f"site-{k + 1}" for k in range(num_sites)),
        site_features=tuple(features[train[p]] for p in parts),
        site_labels=tuple(data.labels[train[p]] for p in parts),
        test_features=features[test],
        test_labels=data.labels[test],
        provenance=f"{surrogate.SURROGATE_LABEL} features (d={d}, seed={surrogate_seed}) on real NIH ChestX-ray14 PA labels",
        surrogate=True,
        info={
            "split": split,
            "seeds": {
                "split": split_seed,
                "partition": partition_seed,
                "surrogate": surrogate_seed,
            },
            "class_set": class_set,
            "n_pa_images": data.n,
            "dropped_by_partition": int(len(train) - sum(len(p) for p in parts)),
            "site_image_ids": [[data.image_ids[i] for i in train[p]] for p in parts],
            "test_image_ids": [data.image_ids[i] for i in test],
        },
        site_patients=tuple(data.patient_ids[train[p]].astype(str) for p in parts),
    )


def save_dataset(fed: FederatedDataset, root: str | os.PathLike[str]) -> list[Path]:
    """Write one feature cache per site plus ``test/``: the format the daemons read."""
    out = Path(root)
    site_ids = fed.info.get("site_image_ids")
    test_ids = fed.info.get("test_image_ids")
    paths = []
    entries: Sequence[tuple[str, NDArray[np.float32], NDArray[np.int8], Sequence[str] | None]] = [
        *zip(
            fed.site_names,
            fed.site_features,
            fed.site_labels,
            site_ids or [None] * fed.num_sites,
            strict=True,
        ),
        ("test", fed.test_features, fed.test_labels, test_ids),
    ]
    patients = [*(fed.site_patients or [None] * fed.num_sites), None]
    for (name, feats, labels, ids), pids in zip(entries, patients, strict=True):
        meta = CacheMeta(
            n=int(feats.shape[0]),
            d=fed.d,
            classes=fed.classes,
            source=fed.provenance,
            surrogate=fed.surrogate,
            extra={"site": name},
        )
        row_ids = list(ids) if ids is not None else [f"{name}-{i}" for i in range(feats.shape[0])]
        write_cache(
            out / name,
            meta=meta,
            ids=row_ids,
            labels=labels,
            features=feats,
            patients=None if pids is None else [str(p) for p in pids],
        )
        paths.append(out / name)
    return paths


def load_dataset(
    site_dirs: Sequence[str | os.PathLike[str]], test_dir: str | os.PathLike[str]
) -> FederatedDataset:
    """A federation from feature caches; every cache must agree on classes and d, labels complete."""
    caches = [open_cache(p) for p in site_dirs]
    test = open_cache(test_dir)
    for cache in [*caches, test]:
        if cache.meta.classes != test.meta.classes or cache.meta.d != test.meta.d:
            raise FeatureCacheError(f"{cache.root}: classes or d differ from the test cache")
        if (cache.labels < 0).any():
            raise FeatureCacheError(
                f"{cache.root}: simulation needs complete ground-truth labels (found -1 entries); "
                "task heterogeneity is applied by the simulation itself"
            )
    return FederatedDataset(
        classes=test.meta.classes,
        site_names=tuple(Path(p).name for p in site_dirs),
        site_features=tuple(c.features for c in caches),
        site_labels=tuple(c.labels for c in caches),
        test_features=test.features,
        test_labels=test.labels,
        provenance=test.meta.provenance,
        surrogate=test.meta.surrogate,
        info={"caches": [str(p) for p in site_dirs], "test_cache": str(test_dir)},
        site_patients=(
            tuple(np.asarray(c.patients, dtype=str) for c in caches if c.patients is not None)
            if all(c.patients is not None for c in caches)
            else None
        ),
    )
