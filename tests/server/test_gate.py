"""The validation gate's verdict and settings (afl.server.solve.gate, docs/protocol.md §6.2,
M-150, M-155). Oracle: scikit-learn's ROC AUC of the pooled scores of generated rows (the binned
AUC agrees within the bins' resolution), and the floor applied by hand."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from afl.core.evaluation.federated import evaluation_statistics
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS
from afl.crypto.identity.custody import RosterSite
from afl.server.config import run_settings
from afl.server.errors import ConfigError
from afl.server.solve.gate import GateSettings, gate_settings_from_table, gate_verdict

CLASSES = ("A", "B", "C")
SITES = {f"s{k}": RosterSite(bytes(32), "participant") for k in range(3)}


def _rows(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    d = 6
    directions = rng.normal(size=(len(CLASSES), d))
    y = (rng.random((400, len(CLASSES))) < 0.4).astype(np.int64)
    h = rng.normal(size=(400, d)) + y @ directions
    return h, y, np.linalg.lstsq(h, 2.0 * y - 1.0, rcond=None)[0]


def _verdict(h: np.ndarray, y: np.ndarray, w: np.ndarray, **floor: Any) -> Any:
    stats = evaluation_statistics(h, y, weights=w, classes=CLASSES, bins=DEFAULT_SCORE_BINS)
    return gate_verdict(stats, members=floor.pop("members", 3), settings=GateSettings(**floor))


def test_the_verdict_applies_the_floor_to_the_pooled_auc() -> None:
    h, y, w = _rows(5)
    exact = [roc_auc_score(y[:, c], h @ w[:, c]) for c in range(len(CLASSES))]
    good = _verdict(h, y, w)
    assert good.passed and good.reason() == "" and not good.failing
    for c, name in enumerate(CLASSES):
        assert abs(good.per_class_auc[name] - exact[c]) < 2e-3
    flipped = w.copy()
    flipped[:, 1] *= -1  # class B inverted: AUC 1 - AUC_B
    bad = _verdict(h, y, flipped)
    assert not bad.passed and bad.failing == ("B",)
    assert abs(bad.per_class_auc["B"] - (1 - exact[1])) < 2e-3
    assert bad.reason().startswith("validation gate failed: classes below min_auc 0.5: B AUC 0.")
    strict = _verdict(h, y, w, min_auc=min(exact) + 0.01)  # the floor just above the worst class
    assert strict.failing == (CLASSES[int(np.argmin(exact))],)
    macro = _verdict(h, y, w, min_auc=0.0, min_macro_auc=float(np.mean(exact)) + 0.01)
    assert not macro.passed and not macro.failing and "macro AUC" in macro.reason()
    few = _verdict(h, y, w, members=1)
    assert not few.passed and "1 site(s) scored it, min_sites = 2" in few.reason()


def test_a_class_without_both_labels_fails_unless_the_run_waives_it() -> None:
    h, y, w = _rows(9)
    y[:, 2] = 0  # no positive of C among the scored rows: no AUC
    assert _verdict(h, y, w).failing == ("C",)
    assert _verdict(h, y, w, require_every_class=False).passed


def test_the_gate_table_is_checked_and_refused_with_dp() -> None:
    assert gate_settings_from_table({}) == GateSettings()
    for bad in ({"min_auc": 1.5}, {"min_sites": 0}, {"floor": 1}, {"min_auc": "high"}):
        with pytest.raises(ValueError):
            gate_settings_from_table(bad)
    base = {"classes": list(CLASSES), "feature_dim": 4}
    settings = run_settings({**base, "gate": {"min_auc": 0.6}}, source="t", sites=SITES)
    assert settings.gate == GateSettings(min_auc=0.6)
    with pytest.raises(ConfigError, match="gate"):
        run_settings({**base, "gate": {"min_sites": 0}}, source="t", sites=SITES)
    dp = {"epsilon": 4.0, "delta": 1e-5, "clip_norm": 1.0}
    with pytest.raises(ConfigError, match="validation gate"):
        run_settings({**base, "gate": {}, "dp": dp}, source="t", sites=SITES)
