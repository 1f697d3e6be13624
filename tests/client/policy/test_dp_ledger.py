"""A site's lifetime DP ledger (afl.client.policy.ledger, docs/protocol.md §7): append-only,
durable across restarts (a new object on the same folder), hash-chained so that a changed,
removed or reordered entry is detected, idempotent for a resumed round, and composed exactly
(oracle: √(Σ μ²) written out, and the independent analytic-Gaussian accountant)."""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path
from typing import Any

import pytest

from afl.client.policy.ledger import DpLedger, LedgerError
from tests.helpers import dp_oracle


def _entry(round_id: str, mu: float, *, unit: str = "patient", sha: str = "aa") -> dict[str, Any]:
    return {
        "federation_id": "fed",
        "round_id": round_id,
        "round_number": 1,
        "run_id": round_id,
        "plan_sha256": sha,
        "aggregation": "AGGREGATION_MODE_MASK",
        "unit": unit,
        "images_per_patient": 1,
        "delta": 1e-5,
        "mu": mu,
        "epsilon": math.inf if math.isinf(mu) else dp_oracle.epsilon(mu, 1e-5),
        "releases": ({"name": "gram[all]", "sensitivity": 1.0, "sigma": 1.0 / max(mu, 1e-9)},),
    }


def test_entries_persist_compose_and_are_idempotent(tmp_path: Path) -> None:
    root = tmp_path / "dp-ledger"
    ledger = DpLedger(root)
    assert ledger.entries() == [] and ledger.spent(unit="patient").mu == 0.0
    first = ledger.record(**_entry("r1", 0.6))
    assert ledger.record(**_entry("r1", 0.6)) == first  # a resumed round: no second entry
    ledger.record(**_entry("r2", 0.8))
    again = DpLedger(root)  # a restarted daemon reads the same ledger
    assert [e.round_id for e in again.entries()] == ["r1", "r2"]
    spent = again.spent(unit="patient")
    assert spent.entries == 2 and spent.mu == pytest.approx(math.sqrt(0.6**2 + 0.8**2))
    assert spent.epsilon(1e-5) == pytest.approx(dp_oracle.epsilon(1.0, 1e-5), rel=1e-9)
    assert again.spent(unit="patient", exclude_round="r2").mu == pytest.approx(0.6)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in root.iterdir())
    assert not list(root.glob(".*.tmp"))


def test_units_and_releases_without_dp(tmp_path: Path) -> None:
    ledger = DpLedger(tmp_path / "l")
    ledger.record(**_entry("r1", 0.5, unit="image"))
    assert ledger.spent(unit="image").mu == pytest.approx(0.5)
    assert ledger.spent(unit="patient").mu == math.inf  # an image bound says nothing of a patient
    ledger.record(**_entry("r2", math.inf))  # a plan without DP
    assert ledger.spent(unit="image").mu == math.inf
    assert ledger.entry_for("r2") is not None and ledger.entry_for("r3") is None


@pytest.mark.parametrize("tamper", ["edit", "delete", "reorder"])
def test_a_changed_removed_or_reordered_entry_is_detected(tmp_path: Path, tamper: str) -> None:
    ledger = DpLedger(tmp_path / "l")
    for i, mu in enumerate((0.3, 0.4, 0.5), start=1):
        ledger.record(**_entry(f"r{i}", mu))
    files = sorted((tmp_path / "l").iterdir())
    if tamper == "edit":
        doc = json.loads(files[0].read_text())
        doc["mu"] = 0.01  # someone lowers what was spent
        files[0].write_text(json.dumps(doc, indent=2, sort_keys=True))
    elif tamper == "delete":
        files[1].unlink()
    else:
        a, b = files[0].read_bytes(), files[1].read_bytes()
        files[0].write_bytes(b)
        files[1].write_bytes(a)
    with pytest.raises(LedgerError, match="DP ledger"):
        ledger.spent(unit="patient")
    with pytest.raises(LedgerError):
        ledger.record(**_entry("r4", 0.1))
