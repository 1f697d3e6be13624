"""Extraction: resumable after a crash, shard + merge = single run, unreadable-file policies."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from afl.client.features.backbones import Preprocessor, load_backbone
from afl.client.features.extract import ExtractError, extract_features
from afl.client.features.merge import merge_shards
from afl.client.features.shards import ShardError, parse_shard, plan_batches, read_unreadable
from afl.client.features.sitedata import UnreadableImageError, manifest_source, read_image
from afl.core.data.featurecache import open_cache
from tests.client.imagegen import make_site, write_dicom

N = 37
BATCH = 4


@pytest.fixture(scope="module")
def backbone():
    """A random-init ResNet-18 on 48 px inputs: fast on CPU, same code path as the real ones."""
    bb = load_backbone("resnet18", random_init=True, seed=0)
    spec = dataclasses.replace(bb.spec, preprocess=Preprocessor("imagenet", 48, 48))
    return dataclasses.replace(bb, spec=spec)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    manifest = make_site(root, N)
    (root / "img" / "005.png").write_bytes(b"corrupt png")
    write_dicom(root / "img" / "d.dcm", np.arange(48 * 40).reshape(48, 40) % 4096)
    trunc = write_dicom(root / "img" / "t.dcm", np.zeros((48, 40)))
    trunc.write_bytes(trunc.read_bytes()[:-1000])
    with open(manifest, "a", encoding="utf-8") as fh:
        fh.write("img/d.dcm,1,0\nimg/t.dcm,0,0\n")
    return manifest_source(manifest)


def _run(source, backbone, out, **kw):
    kw.setdefault("batch_size", BATCH)
    return extract_features(source, backbone, out, progress=False, **kw)


def _same_cache(a, b):
    assert a.features.tobytes() == b.features.tobytes()
    assert a.ids == b.ids
    np.testing.assert_array_equal(a.labels, b.labels)
    assert (a.meta.n, a.meta.d, a.meta.classes, a.meta.source) == (
        b.meta.n,
        b.meta.d,
        b.meta.classes,
        b.meta.source,
    )


@pytest.fixture(scope="module")
def single(site, backbone, tmp_path_factory):
    return _run(site, backbone, tmp_path_factory.mktemp("single") / "cache")


def test_single_run_matches_a_direct_forward_and_reports_bad_files(single, site, backbone):
    cache = single.cache
    bad = {u.id for u in single.unreadable}
    assert bad == {"img/005.png", "img/t.dcm"}
    assert {u.id for u in read_unreadable(cache.root)} == bad
    assert cache.meta.n == N + 2 - 2 and cache.meta.extra["n_unreadable"] == 2
    assert cache.meta.random_init and "RANDOM-INIT" in cache.meta.provenance
    assert "img/d.dcm" in cache.ids and not (cache.root.parent / "cache.partial").exists()
    keep = [r for r in site.records if r.id not in bad]
    assert list(cache.ids) == [r.id for r in keep]
    np.testing.assert_array_equal(
        cache.labels, site.labels[[r.id not in bad for r in site.records]]
    )
    # oracle: the backbone applied directly to the first batch (same composition)
    x = torch.stack([backbone.preprocess(read_image(r.path)) for r in site.records[:BATCH]])
    with torch.inference_mode():
        direct = backbone.module(x).numpy()
    np.testing.assert_array_equal(cache.features[:BATCH], direct)


def test_rerun_is_deterministic_and_complete_cache_is_reused(single, site, backbone, tmp_path):
    again = _run(site, backbone, tmp_path / "again", workers=2)
    _same_cache(again.cache, single.cache)
    reuse = _run(site, backbone, tmp_path / "again", workers=2)
    assert reuse.images_done == 0 and len(reuse.unreadable) == 2


def test_resume_after_crash_is_byte_identical(single, site, backbone, tmp_path):
    class Crash(Exception):
        pass

    seen = []

    def crash_after_three(done, total):
        seen.append(done)
        if len(seen) == 3:
            raise Crash

    out = tmp_path / "cache"
    with pytest.raises(Crash):
        _run(site, backbone, out, on_batch=crash_after_three)
    partial = open_cache(tmp_path / "cache.partial", allow_partial=True)
    assert partial.rows_done == 3 * BATCH and not out.exists()
    resumed = _run(site, backbone, out)
    assert resumed.images_done == N + 2 - 3 * BATCH
    _same_cache(resumed.cache, single.cache)
    assert (out / "features.npy").read_bytes() == (single.cache.root / "features.npy").read_bytes()
    assert (out / "unreadable.csv").read_bytes() == (
        single.cache.root / "unreadable.csv"
    ).read_bytes()


def test_resume_refuses_other_settings(site, backbone, tmp_path):
    def crash(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(site, backbone, tmp_path / "c", on_batch=crash)
    with pytest.raises(ExtractError, match="batch_size"):
        _run(site, backbone, tmp_path / "c", batch_size=BATCH + 1)


@pytest.mark.parametrize(("count", "mode"), [(3, "contiguous"), (4, "strided"), (1, "strided")])
def test_shard_and_merge_equal_single_run(single, site, backbone, tmp_path, count, mode):
    dirs = []
    for i in range(count):
        res = _run(site, backbone, tmp_path / f"s{i}", shard=(i, count), shard_mode=mode)
        dirs.append(res.cache.root)
    merged = merge_shards(list(reversed(dirs)), tmp_path / "merged")
    _same_cache(merged, single.cache)
    assert merged.meta.extra["n_unreadable"] == 2
    assert {u.id for u in read_unreadable(merged.root)} == {"img/005.png", "img/t.dcm"}
    # statistics are additive: Σ_shards H_sᵀH_s = HᵀH of the single run (float64)
    gram = sum(
        np.asarray(open_cache(d).features, np.float64).T @ np.asarray(open_cache(d).features)
        for d in dirs
    )
    h = np.asarray(single.cache.features, np.float64)
    np.testing.assert_allclose(gram, h.T @ h, rtol=1e-10, atol=1e-8)


def test_merge_rejects_incomplete_or_foreign_shards(site, backbone, tmp_path):
    a = _run(site, backbone, tmp_path / "a", shard=(0, 2)).cache.root
    with pytest.raises(ShardError, match="exactly once"):
        merge_shards([a], tmp_path / "m")
    other = _run(site, backbone, tmp_path / "b", shard=(1, 2), batch_size=BATCH * 2).cache.root
    with pytest.raises(ShardError, match="batch_size"):
        merge_shards([a, other], tmp_path / "m")


def test_fail_policy_names_the_file(site, backbone, tmp_path):
    with pytest.raises(UnreadableImageError, match=r"005\.png"):
        _run(site, backbone, tmp_path / "c", on_error="fail")
    # the batches before the bad one are committed: fixing the file and re-running resumes
    assert open_cache(tmp_path / "c.partial", allow_partial=True).rows_done == BATCH
    with pytest.raises(ExtractError, match="on_error"):
        _run(site, backbone, tmp_path / "d", on_error="ignore")


def test_plan_batches_partition_rows():
    for n, bs, count in [(37, 4, 3), (5, 8, 2), (0, 4, 2), (100, 7, 5)]:
        for mode in ("contiguous", "strided"):
            rows = sorted(
                r
                for i in range(count)
                for b in plan_batches(n, batch_size=bs, shard=(i, count), mode=mode)
                for r in b
            )
            assert rows == list(range(n))
    assert parse_shard("2/5") == (2, 5)
    for bad in ("5/5", "x", "1/0", "-1/2"):
        with pytest.raises(ShardError):
            parse_shard(bad)


def test_patient_ids_follow_the_kept_rows_through_extraction_and_merge(backbone, tmp_path):
    manifest = make_site(tmp_path / "p", 9)
    lines = manifest.read_text(encoding="utf-8").splitlines()
    lines = [lines[0] + ",patient"] + [f"{line},pt{i // 2}" for i, line in enumerate(lines[1:])]
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "p" / "img" / "004.png").write_bytes(b"corrupt png")  # row 4 (patient pt2)
    source = manifest_source(manifest)
    single = _run(source, backbone, tmp_path / "single").cache
    expected = tuple(f"pt{i // 2}" for i in range(9) if i != 4)
    assert single.patients == expected and len(single.ids) == len(expected)
    dirs = [_run(source, backbone, tmp_path / f"s{i}", shard=(i, 2)).cache.root for i in range(2)]
    assert merge_shards(dirs, tmp_path / "merged").patients == expected
