"""NIH ChestX-ray14 protocol: the metadata facts of docs/method.md §2 and the FedMLP
split/partition."""

from __future__ import annotations

import gzip
import importlib.util
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.model_selection import train_test_split

from afl.core.data import nih


def test_pa_counts_and_prevalence(pa: nih.NihLabels) -> None:
    assert pa.n == 67_310
    assert len(np.unique(pa.patient_ids)) == 28_868
    assert pa.labels.dtype == np.int8 and pa.labels.shape == (67_310, 8)
    assert set(np.unique(pa.labels)) == {0, 1}
    expected = [8.51, 2.32, 9.79, 13.90, 5.30, 6.21, 0.94, 5.06]
    np.testing.assert_array_equal(np.round(100 * pa.prevalence(), 2), expected)


def test_top8_pa_is_really_top8_by_count() -> None:
    allf = nih.load_pa_labels(classes=nih.ALL_FINDINGS)
    counts = dict(zip(allf.classes, allf.labels.sum(axis=0).tolist(), strict=True))
    top8 = sorted(counts, key=lambda c: -counts[c])[:8]
    assert set(top8) == set(nih.TOP8_PA_CLASSES)
    assert set(nih.TOP8_PA_CLASSES) ^ set(nih.PAPER_CLASSES) == {"Pneumonia", "Pleural_Thickening"}
    assert nih.CLASS_SETS == {"paper": nih.PAPER_CLASSES, "top8-pa": nih.TOP8_PA_CLASSES}


def test_default_metadata_is_torchxrayvision_copy_without_importing_torch() -> None:
    code = (
        "import sys; from afl.core.data import nih; l = nih.load_pa_labels(); "
        "assert l.n == 67310; "
        "assert 'torch' not in sys.modules and 'torchxrayvision' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    path = nih.find_metadata()
    assert path.name == nih.METADATA_FILENAME and "torchxrayvision" in str(path)


def test_missing_package_gives_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(nih.NihMetadataError, match=r"pip install torchxrayvision.*--metadata"):
        nih.find_metadata()
    with pytest.raises(nih.NihMetadataError, match="not found"):
        nih.find_metadata("/nonexistent/Data_Entry.csv")


CSV_TEXT = (
    "Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,View Position\n"
    "a.png,Cardiomegaly|Effusion,0,7,50,M,PA\n"
    "b.png,No Finding,0,7,51,M,AP\n"
    "c.png,Pneumonia,0,9,30,F,PA\n"
    "d.png,No Finding,1,9,31,F,PA\n"
)


@pytest.mark.parametrize("gz", [False, True])
def test_explicit_metadata_path_plain_or_gzip(tmp_path, gz: bool) -> None:
    path = tmp_path / ("meta.csv.gz" if gz else "meta.csv")
    path.write_bytes(gzip.compress(CSV_TEXT.encode()) if gz else CSV_TEXT.encode())
    lab = nih.load_pa_labels(classes=("Effusion", "Pneumonia", "Cardiomegaly"), metadata_path=path)
    assert lab.image_ids == ("a.png", "c.png", "d.png")
    np.testing.assert_array_equal(lab.patient_ids, [7, 9, 9])
    np.testing.assert_array_equal(lab.labels, [[1, 0, 1], [0, 1, 0], [0, 0, 0]])
    ap = nih.load_pa_labels(classes=("Effusion",), metadata_path=path, view="AP")
    assert ap.image_ids == ("b.png",)


def test_bad_inputs(tmp_path) -> None:
    path = tmp_path / "m.csv"
    path.write_text(CSV_TEXT)
    with pytest.raises(nih.NihMetadataError, match="findings"):
        nih.load_pa_labels(classes=("Atelectasis", "Flu"), metadata_path=path)
    with pytest.raises(nih.NihMetadataError, match="View Position"):
        nih.load_pa_labels(metadata_path=path, view="LL")
    bad = tmp_path / "bad.csv"
    bad.write_text("x,y\n1,2\n")
    with pytest.raises(nih.NihMetadataError, match="missing columns"):
        nih.load_pa_labels(metadata_path=bad)


def test_image_split_reproduces_fedmlp_counts_and_sklearn(pa: nih.NihLabels) -> None:
    train, test = nih.split_train_test(pa, mode="image", train_fraction=0.7, seed=2023)
    assert (len(train), len(test)) == (47_116, 20_194)
    sk_train, sk_test = train_test_split(np.arange(pa.n), test_size=1 - 0.7, random_state=2023)
    np.testing.assert_array_equal(train, sk_train)
    np.testing.assert_array_equal(test, sk_test)
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(pa.n))


def test_patient_split_on_nih(pa: nih.NihLabels) -> None:
    train, test = nih.split_train_test(pa, mode="patient", seed=2023)
    assert not set(pa.patient_ids[train]) & set(pa.patient_ids[test])
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(pa.n))
    biggest = Counter(pa.patient_ids.tolist()).most_common(1)[0][1]
    assert 47_116 - biggest < len(train) <= 47_116


@settings(max_examples=50, deadline=None)
@given(
    pids=st.lists(st.integers(0, 30), min_size=4, max_size=200),
    frac=st.floats(0.2, 0.8),
    seed=st.integers(0, 2**31),
)
def test_patient_split_properties(pids: list[int], frac: float, seed: int) -> None:
    arr = np.asarray(pids, dtype=np.int64)
    try:
        train, test = nih.split_train_test(arr, mode="patient", train_fraction=frac, seed=seed)
    except ValueError as exc:  # only a side left empty is acceptable
        assert "empty side" in str(exc)
        return
    assert not set(arr[train]) & set(arr[test])
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(len(arr)))
    again = nih.split_train_test(arr, mode="patient", train_fraction=frac, seed=seed)
    assert np.array_equal(again[0], train)


def test_split_errors() -> None:
    with pytest.raises(ValueError, match="patient ids"):
        nih.split_train_test(100, mode="patient")
    with pytest.raises(ValueError, match="train_fraction"):
        nih.split_train_test(100, train_fraction=1.0)
    with pytest.raises(ValueError, match="mode"):
        nih.split_train_test(100, mode="site")  # type: ignore[arg-type]


def test_iid_partition_fedmlp() -> None:
    parts = nih.iid_partition(47_116, num_clients=8, seed=1037)
    assert [len(p) for p in parts] == [5_889] * 8
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == 47_112 and joined.min() >= 0 and joined.max() < 47_116
    again = nih.iid_partition(47_116, num_clients=8, seed=1037)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = nih.iid_partition(47_116, num_clients=8, seed=1)
    assert not np.array_equal(parts[0], other[0])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 12), seed=st.integers(0, 2**31))
def test_iid_partition_properties(n: int, k: int, seed: int) -> None:
    if n < k:
        with pytest.raises(ValueError):
            nih.iid_partition(n, num_clients=k, seed=seed)
        return
    kept = nih.iid_partition(n, num_clients=k, seed=seed)
    assert all(len(p) == n // k for p in kept)
    assert len(np.unique(np.concatenate(kept))) == k * (n // k)
    full = nih.iid_partition(n, num_clients=k, seed=seed, drop_remainder=False)
    assert np.array_equal(np.sort(np.concatenate(full)), np.arange(n))
    assert max(map(len, full)) - min(map(len, full)) <= 1
