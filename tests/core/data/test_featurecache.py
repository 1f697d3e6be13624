"""The feature cache: round trip, crash-resume, validation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from afl.core.data.featurecache import (
    CacheMeta,
    FeatureCacheError,
    FeatureCacheWriter,
    open_cache,
    write_cache,
)


def _meta(n=10, d=4):
    return CacheMeta(n=n, d=d, classes=("a", "b"), source="test", surrogate=True)


def _labels(n=10):
    return np.tile(np.array([[1, -1], [0, -1]], dtype=np.int8), (n // 2, 1))


def test_roundtrip(tmp_path):
    feats = np.arange(40, dtype=np.float32).reshape(10, 4)
    ids = [f"img{i}" for i in range(10)]
    cache = write_cache(tmp_path / "c", meta=_meta(), ids=ids, labels=_labels(), features=feats)
    assert cache.complete and cache.ids == tuple(ids)
    np.testing.assert_array_equal(cache.features, feats)
    np.testing.assert_array_equal(cache.labels, _labels())
    assert "SURROGATE" in cache.meta.provenance


def test_resume_after_crash_is_byte_identical(tmp_path):
    feats = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
    ids = [str(i) for i in range(10)]
    ref = write_cache(tmp_path / "ref", meta=_meta(), ids=ids, labels=_labels(), features=feats)
    w = FeatureCacheWriter.create_or_resume(tmp_path / "c", meta=_meta(), ids=ids, labels=_labels())
    w.write_rows(0, feats[:3])
    del w  # "crash"
    with pytest.raises(FeatureCacheError, match="incomplete"):
        open_cache(tmp_path / "c")
    w2 = FeatureCacheWriter.create_or_resume(
        tmp_path / "c", meta=_meta(), ids=ids, labels=_labels()
    )
    assert w2.rows_done == 3
    w2.write_rows(3, feats[3:])
    assert (tmp_path / "c" / "features.npy").read_bytes() == (
        ref.root / "features.npy"
    ).read_bytes()


def test_writer_rejects_bad_blocks_and_foreign_caches(tmp_path):
    ids = [str(i) for i in range(10)]
    w = FeatureCacheWriter.create_or_resume(tmp_path / "c", meta=_meta(), ids=ids, labels=_labels())
    with pytest.raises(FeatureCacheError, match="in order"):
        w.write_rows(2, np.zeros((1, 4)))
    with pytest.raises(FeatureCacheError, match=r"\(rows, 4\)"):
        w.write_rows(0, np.zeros((1, 5)))
    with pytest.raises(FeatureCacheError, match="non-finite"):
        w.write_rows(0, np.full((1, 4), np.inf))
    with pytest.raises(FeatureCacheError, match="different cache"):
        FeatureCacheWriter.create_or_resume(
            tmp_path / "c", meta=_meta(), ids=[f"x{i}" for i in range(10)], labels=_labels()
        )
    with pytest.raises(FeatureCacheError, match="labels"):
        FeatureCacheWriter.create_or_resume(
            tmp_path / "d", meta=_meta(), ids=ids, labels=np.full((10, 2), 7)
        )


def test_open_rejects_non_caches(tmp_path):
    with pytest.raises(FeatureCacheError, match=r"no meta\.json"):
        open_cache(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(FeatureCacheError, match="not an afl-feature-cache"):
        open_cache(tmp_path)


def test_patient_ids_round_trip_and_old_caches_have_none(tmp_path):
    feats = np.zeros((10, 4), dtype=np.float32)
    ids = [f"img{i}" for i in range(10)]
    patients = [f"p{i // 3}" for i in range(10)]
    cache = write_cache(
        tmp_path / "c", meta=_meta(), ids=ids, labels=_labels(), features=feats, patients=patients
    )
    assert cache.patients == tuple(patients)
    assert open_cache(tmp_path / "c").patients == tuple(patients)
    old = write_cache(tmp_path / "old", meta=_meta(), ids=ids, labels=_labels(), features=feats)
    assert old.patients is None and not (tmp_path / "old" / "patients.txt").exists()
    with pytest.raises(FeatureCacheError, match="different cache"):
        FeatureCacheWriter.create_or_resume(
            tmp_path / "c", meta=_meta(), ids=ids, labels=_labels(), patients=patients[::-1]
        )
    for bad, word in ((patients[:3], "3 patient ids"), (["", *patients[1:]], "non-empty")):
        with pytest.raises(FeatureCacheError, match=word):
            write_cache(
                tmp_path / f"bad{len(bad)}", meta=_meta(), ids=ids, labels=_labels(),
                features=feats, patients=bad,
            )  # fmt: skip
    (tmp_path / "c" / "patients.txt").write_text("p0\np1\n", encoding="utf-8")
    with pytest.raises(FeatureCacheError, match=r"patients\.txt"):
        open_cache(tmp_path / "c")
