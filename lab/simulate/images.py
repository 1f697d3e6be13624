"""The paper's experiment on real images: NIH folder -> backbone features -> the same federation.

``afl simulate --images DIR --weights FILE`` extracts features of every PA image once into a
resumable cache (``afl.client.features.extract``), then builds exactly the protocol of the embedded default
(FedMLP's 7:3 split of the PA rows in CSV order, IID sites) on the real features. Images that
could not be read are listed by the extractor (``unreadable.csv``) and left out of the split;
their number is reported with the results, never dropped silently.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np

from afl.client.features.backbones import load_backbone
from afl.client.features.extract import extract_features
from afl.client.features.sitedata import nih_source
from afl.core.data import nih
from afl.core.data.featurecache import FeatureCacheError
from afl.lab.simulate.dataset import FederatedDataset


def _nih_table(root: Path) -> Path:
    found = sorted(root.glob("Data_Entry_2017*.csv")) + sorted(root.glob("Data_Entry_2017*.csv.gz"))
    if not found:
        raise FeatureCacheError(
            f"{root}: no Data_Entry_2017*.csv (NIH ChestX-ray14 layout expected)"
        )
    return found[0]


def image_federation(
    *,
    images: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str],
    backbone: str = "xrv-densenet121-all",
    weights: str | os.PathLike[str] | None = None,
    sha256: str | None = None,
    random_init: bool = False,
    class_set: str = "paper",
    split: Literal["image", "patient"] = "image",
    num_sites: int = 8,
    batch_size: int = 32,
    workers: int = 2,
    device: str = "auto",
    progress: bool = True,
) -> FederatedDataset:
    """Extract (or resume) features of all PA images, then split and partition as FedMLP."""
    root = Path(images)
    classes = nih.CLASS_SETS[class_set]
    source = nih_source(root, classes=classes, views=("PA",))
    model = load_backbone(backbone, weights=weights, sha256=sha256, random_init=random_init)
    result = extract_features(
        source,
        model,
        Path(cache_dir) / f"{backbone}-pa",
        batch_size=batch_size,
        workers=workers,
        device=device,
        on_error="skip",
        progress=progress,
    )
    cache = result.cache
    data = nih.load_pa_labels(classes=classes, metadata_path=_nih_table(root))
    row_of = {image_id: i for i, image_id in enumerate(cache.ids)}
    present = np.array([image_id in row_of for image_id in data.image_ids])
    train, test = nih.split_train_test(data, mode=split)
    train, test = train[present[train]], test[present[test]]
    parts = nih.iid_partition(len(train), num_clients=num_sites)

    def rows(indices: np.ndarray) -> np.ndarray:
        return np.array([row_of[data.image_ids[i]] for i in indices], dtype=np.int64)

    features = cache.features
    return FederatedDataset(
        classes=data.classes,
        site_names=tuple(f"site-{k + 1}" for k in range(num_sites)),
        site_features=tuple(np.asarray(features[np.sort(rows(train[p]))]) for p in parts),
        site_labels=tuple(cache.labels[np.sort(rows(train[p]))] for p in parts),
        test_features=np.asarray(features[np.sort(rows(test))]),
        test_labels=cache.labels[np.sort(rows(test))],
        provenance=cache.meta.provenance,
        surrogate=False,
        info={
            "split": split,
            "class_set": class_set,
            "images": str(root),
            "feature_cache": str(cache.root),
            "n_pa_images": data.n,
            "unreadable_or_missing_images": int((~present).sum()),
            "random_init": cache.meta.random_init,
        },
    )
