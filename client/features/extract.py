"""Images → feature cache: batched, resumable, shardable extraction (docs/method.md §1, docs/operations.md).

``H = f_backbone(x)`` for every image of a site (paper eq. 1), written block by block through
:class:`afl.core.data.featurecache.FeatureCacheWriter` into a staging cache ``OUT.partial``; a crash
loses at most the batch in flight and re-running the same command resumes at the last committed
row. Unreadable images are run as zero images (so every other image keeps its batch) and are
recorded durably in ``OUT.partial/unreadable.jsonl`` before the batch commits; with policy
``fail`` the run stops with the file's name instead. When every row is done, the staging cache
is compacted into ``OUT`` without the unreadable rows, which are listed in ``OUT/unreadable.csv``
and counted in ``meta.extra["n_unreadable"]``. Merging shards is in ``afl.client.features.merge``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from tqdm import tqdm

from afl.client.features.backbones import Backbone
from afl.client.features.shards import (
    Unreadable,
    data_fingerprint,
    plan_batches,
    read_unreadable,
    write_unreadable,
)
from afl.client.features.sitedata import ImageRecord, SiteSource, UnreadableImageError, read_image
from afl.core.data.featurecache import CacheMeta, FeatureCache, FeatureCacheWriter, open_cache

ON_ERROR = ("skip", "fail")
_FAILED_LOG = "unreadable.jsonl"


class ExtractError(Exception):
    """Inconsistent extraction options, or a staging cache that belongs to another run."""


@dataclass(frozen=True)
class ExtractResult:
    cache: FeatureCache
    unreadable: tuple[Unreadable, ...]
    images_done: int  # images processed by this call (0 when the cache was already complete)
    seconds: float

    @property
    def images_per_s(self) -> float:
        return self.images_done / self.seconds if self.seconds > 0 else 0.0


class ImageRows(torch.utils.data.Dataset):  # type: ignore[misc]
    """Row i → (i, preprocessed tensor, error text); an unreadable file yields zeros + reason."""

    def __init__(self, records: Sequence[ImageRecord], preprocess: Callable[[Any], Any]):
        self.records = records
        self.preprocess = preprocess
        size = getattr(preprocess, "crop_size", 224)
        self.blank_shape = (getattr(preprocess, "channels", 1), size, size)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[int, Any, str]:
        try:
            return i, self.preprocess(read_image(self.records[i].path)), ""
        except UnreadableImageError as exc:
            return i, torch.zeros(self.blank_shape), str(exc)
        except Exception as exc:  # a decodable but unusable image (e.g. degenerate size)
            return i, torch.zeros(self.blank_shape), f"{self.records[i].path}: {exc!r}"


def resolve_device(device: str) -> Any:
    """``auto`` → CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _meta(source: SiteSource, backbone: Backbone, n: int, extra: dict[str, Any]) -> CacheMeta:
    return CacheMeta(
        n=n, d=backbone.dim, classes=source.classes, source=backbone.source,
        random_init=backbone.random_init, extra=extra,
    )  # fmt: skip


def _check_resumable(staging: Path, meta: CacheMeta) -> None:
    if not (staging / "meta.json").exists():
        return
    old = open_cache(staging, allow_partial=True).meta
    diff = [k for k in set(old.extra) | set(meta.extra) if old.extra.get(k) != meta.extra.get(k)]
    if old.source != meta.source:
        diff.append("source (backbone/weights)")
    if diff or old != meta:
        shown = ", ".join(f"{k}: {old.extra.get(k)!r} -> {meta.extra.get(k)!r}" for k in diff)
        raise ExtractError(
            f"{staging} holds an interrupted extraction with other settings ({shown or 'meta'}); "
            "re-run with the same options to resume, or delete that directory to start over"
        )


def _read_failed(staging: Path, rows_done: int) -> list[Unreadable]:
    """Failures of committed rows; entries of the uncommitted batch are dropped (redone)."""
    log = staging / _FAILED_LOG
    if not log.exists():
        return []
    items = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line]
    kept = [it for it in items if it["pos"] < rows_done]
    log.write_text("".join(json.dumps(it) + "\n" for it in kept), encoding="utf-8")
    return [Unreadable(it["row"], it["id"], it["path"], it["error"]) for it in kept]


def _append_failed(staging: Path, entries: list[dict[str, Any]]) -> None:
    with open(staging / _FAILED_LOG, "a", encoding="utf-8") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in entries)
        fh.flush()
        os.fsync(fh.fileno())


def _compact(staging: Path, out: Path, rows: list[int], failed: list[Unreadable]) -> FeatureCache:
    """Copy the staging cache into ``out`` without the unreadable rows (streamed in chunks)."""
    part = open_cache(staging)
    bad = {u.row for u in failed}
    keep = np.array([p for p, r in enumerate(rows) if r not in bad], dtype=np.int64)
    meta = replace(part.meta, n=len(keep), extra={**part.meta.extra, "n_unreadable": len(bad)})
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ids = [part.ids[p] for p in keep]
    patients = None if part.patients is None else [part.patients[p] for p in keep]
    writer = FeatureCacheWriter.create_or_resume(
        tmp, meta=meta, ids=ids, labels=part.labels[keep], patients=patients
    )
    for start in range(0, len(keep), 8192):
        writer.write_rows(start, np.asarray(part.features[keep[start : start + 8192]]))
    write_unreadable(tmp, failed)
    os.replace(tmp, out)
    shutil.rmtree(staging)
    return open_cache(out)


def extract_features(
    source: SiteSource,
    backbone: Backbone,
    out: str | os.PathLike[str],
    *,
    batch_size: int = 32,
    workers: int = 0,
    device: str = "auto",
    bf16: bool = False,
    channels_last: bool = False,
    shard: tuple[int, int] = (0, 1),
    shard_mode: str = "contiguous",
    on_error: str = "skip",
    progress: bool = True,
    on_batch: Callable[[int, int], None] | None = None,
) -> ExtractResult:
    """Extract features of ``source`` (or of one shard of it) into the cache ``out``.

    Re-running the same call resumes an interrupted run; on an already complete ``out`` it
    returns that cache. ``on_batch(rows_done, rows_total)`` is called after each committed batch.
    """
    if on_error not in ON_ERROR:
        raise ExtractError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    t0 = time.perf_counter()
    dev = resolve_device(device)
    batches = plan_batches(len(source.records), batch_size=batch_size, shard=shard, mode=shard_mode)
    rows = [r for b in batches for r in b]
    extra = {
        "backbone": backbone.spec.name, "weights_sha256": backbone.weights_sha256,
        "preprocess": repr(backbone.preprocess), "data": source.description,
        "data_fingerprint": data_fingerprint(source), "source_n": len(source.records),
        "batch_size": batch_size, "shard": list(shard), "shard_mode": shard_mode,
        "device_type": dev.type, "bf16": bf16, "channels_last": channels_last,
    }  # fmt: skip
    meta = _meta(source, backbone, len(rows), extra)
    target = Path(out)
    if (target / "meta.json").exists():
        done = open_cache(target)
        same = {k: v for k, v in done.meta.extra.items() if k != "n_unreadable"} == extra
        if not same or replace(done.meta, n=meta.n, extra=extra) != meta:
            raise ExtractError(
                f"{target} already holds a different cache; choose another output or delete it"
            )
        return ExtractResult(done, tuple(read_unreadable(target)), 0, time.perf_counter() - t0)
    staging = target.with_name(target.name + ".partial")
    _check_resumable(staging, meta)
    recs = [source.records[r] for r in rows]
    labels = source.labels[rows] if rows else np.zeros((0, len(source.classes)), np.int8)
    patients = [r.patient for r in recs] if source.patients is not None else None
    writer = FeatureCacheWriter.create_or_resume(
        staging, meta=meta, ids=[r.id for r in recs], labels=labels, patients=patients
    )
    failed = _read_failed(staging, writer.rows_done)
    start, pos = 0, 0
    while pos < writer.rows_done:
        pos += len(batches[start])
        start += 1
    if pos != writer.rows_done:
        raise ExtractError(f"{staging}: progress {writer.rows_done} is not at a batch boundary")
    offsets = np.cumsum([0, *map(len, batches)]).tolist()
    sampler = [list(range(offsets[b], offsets[b + 1])) for b in range(start, len(batches))]
    module = backbone.module.to(dev)
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    loader = torch.utils.data.DataLoader(
        ImageRows(recs, backbone.preprocess), batch_sampler=sampler, num_workers=workers,
        pin_memory=dev.type == "cuda", prefetch_factor=4 if workers else None,
    )  # fmt: skip

    def commit(first: int, feats: Any, errs: list[str]) -> None:
        block: NDArray[np.float32] = feats.float().cpu().numpy()
        bad = [j for j, e in enumerate(errs) if e]
        if bad:
            block[bad] = 0.0
            new = [
                Unreadable(rows[first + j], recs[first + j].id, str(recs[first + j].path), errs[j])
                for j in bad
            ]
            _append_failed(
                staging, [{"pos": first + j, **asdict(u)} for j, u in zip(bad, new, strict=True)]
            )
            failed.extend(new)
        writer.write_rows(first, block)
        bar.update(block.shape[0])
        if on_batch is not None:
            on_batch(writer.rows_done, meta.n)

    pending: tuple[int, Any, list[str]] | None = None
    done_before = writer.rows_done
    with (
        torch.inference_mode(),
        tqdm(total=meta.n, initial=done_before, unit="img", disable=not progress) as bar,
    ):
        for idx, x, errs in loader:
            if on_error == "fail" and any(errs):
                if pending is not None:
                    commit(*pending)
                raise UnreadableImageError(
                    f"{next(e for e in errs if e)} (on_error=fail; use skip to report and go on)"
                )
            x = x.to(dev, non_blocking=True)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                feats = module(x)  # asynchronous on CUDA: commit the previous batch meanwhile
            if pending is not None:
                commit(*pending)
            pending = (int(idx[0]), feats, list(errs))
        if pending is not None:
            commit(*pending)
    cache = _compact(staging, target, rows, failed)
    processed = meta.n - done_before
    return ExtractResult(cache, tuple(failed), processed, time.perf_counter() - t0)
