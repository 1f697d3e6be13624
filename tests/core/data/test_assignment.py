"""Missing-m assignments, coverage spec files and the printed assignment table."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from afl.core.data.assignment import (
    AssignmentError,
    format_assignment,
    load_coverage_spec,
    missing_m_assignment,
)

CLASSES = ["Atelectasis", "Cardiomegaly", "Effusion"]


@settings(max_examples=150, deadline=None)
@given(
    k=st.integers(1, 10),
    c=st.integers(1, 10),
    m=st.integers(0, 9),
    seed=st.integers(0, 2**32 - 1),
)
def test_missing_m_properties(k: int, c: int, m: int, seed: int) -> None:
    assume(m < c and k * (c - m) >= c)
    active = missing_m_assignment(num_clients=k, num_classes=c, missing=m, seed=seed)
    assert active.dtype == np.bool_ and active.shape == (k, c)
    assert (active.sum(axis=1) == c - m).all()  # each client labels C - m classes
    assert active.any(axis=0).all()  # every class has a labeller
    again = missing_m_assignment(num_clients=k, num_classes=c, missing=m, seed=seed)
    assert np.array_equal(active, again)  # deterministic for a seed


def test_paper_settings() -> None:
    eye = missing_m_assignment(num_clients=8, num_classes=8, missing=7, seed=1037)
    assert np.array_equal(eye, np.eye(8, dtype=bool))  # Missing 7: client i labels class i
    draws = [missing_m_assignment(missing=5, seed=s) for s in range(20)]
    assert len({d.tobytes() for d in draws}) > 1  # the seed matters
    assert all((d.sum(axis=1) == 3).all() and d.any(axis=0).all() for d in draws)


def test_draw_is_not_biased_to_one_pattern() -> None:
    # Missing 6 (2 classes per client): over many seeds every class is drawn by every client.
    total = sum(missing_m_assignment(missing=6, seed=s).astype(int) for s in range(200))
    assert (np.asarray(total) > 0).all()


@pytest.mark.parametrize(
    ("k", "c", "m", "msg"),
    [
        (2, 8, 5, "infeasible"),
        (8, 8, 8, "missing must be"),
        (8, 8, -1, "missing must be"),
        (0, 8, 1, "at least one"),
    ],
)
def test_infeasible(k: int, c: int, m: int, msg: str) -> None:
    with pytest.raises(AssignmentError, match=msg):
        missing_m_assignment(num_clients=k, num_classes=c, missing=m, seed=0)


def _spec(**over: object) -> dict[str, object]:
    raw: dict[str, object] = {
        "classes": CLASSES,
        "sites": ["a", "b"],
        "labels": {"a": ["Atelectasis", "Effusion"], "b": ["Cardiomegaly"]},
    }
    raw.update(over)
    return raw


def test_json_and_toml_specs(tmp_path) -> None:
    jpath = tmp_path / "cov.json"
    jpath.write_text(json.dumps(_spec()))
    tpath = tmp_path / "cov.toml"
    tpath.write_text(
        'classes = ["Atelectasis", "Cardiomegaly", "Effusion"]\nsites = ["a", "b"]\n'
        '[labels]\na = ["Atelectasis", "Effusion"]\nb = ["Cardiomegaly"]\n'
    )
    for path in (jpath, tpath):
        spec = load_coverage_spec(path)
        assert spec.classes == tuple(CLASSES) and spec.sites == ("a", "b")
        assert np.array_equal(spec.active, [[True, False, True], [False, True, False]])
        assert spec.classes_of("a") == ("Atelectasis", "Effusion")


@pytest.mark.parametrize(
    ("over", "msg"),
    [
        ({"labels": {"a": ["Atelectasis", "Flu"], "b": ["Cardiomegaly"]}}, "unknown classes"),
        ({"labels": {"a": CLASSES, "b": [], "z": []}}, "unknown sites"),
        ({"labels": {"a": CLASSES}}, "no labels entry"),
        ({"labels": {"a": ["Atelectasis"], "b": ["Effusion"]}}, "labelled by no site"),
        ({"classes": ["Mass", "Mass"]}, "duplicates"),
        ({"sites": []}, "at least one"),
        ({"labels": {"a": "Atelectasis", "b": []}}, "list of non-empty strings"),
        ({"extra": 1}, "exactly the keys"),
    ],
)
def test_spec_validation(tmp_path, over: dict[str, object], msg: str) -> None:
    path = tmp_path / "cov.json"
    path.write_text(json.dumps(_spec(**over)))
    with pytest.raises(AssignmentError, match=msg):
        load_coverage_spec(path)


def test_spec_unreadable(tmp_path) -> None:
    with pytest.raises(AssignmentError, match="cannot read"):
        load_coverage_spec(tmp_path / "none.json")
    bad = tmp_path / "bad.toml"
    bad.write_text("classes = [")
    with pytest.raises(AssignmentError, match="not valid toml"):
        load_coverage_spec(bad)


def test_empty_site_allowed(tmp_path) -> None:
    path = tmp_path / "cov.json"
    path.write_text(json.dumps(_spec(labels={"a": CLASSES, "b": []})))
    assert not load_coverage_spec(path).active[1].any()


def test_format_assignment() -> None:
    active = np.array([[True, False, True], [False, True, True]])
    text = format_assignment(active, CLASSES, ["site-0", "site-1"])
    lines = text.splitlines()
    assert lines[0].split() == ["class", "site-0", "site-1", "#sites"]
    assert lines[1].split() == ["Atelectasis", "x", ".", "1"]
    assert lines[3].split() == ["Effusion", "x", "x", "2"]
    assert lines[-1].split() == ["#classes", "2", "2"]
    with pytest.raises(AssignmentError, match="shape"):
        format_assignment(active, CLASSES, ["only-one"])
