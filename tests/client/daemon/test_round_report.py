"""A site's round report (afl.client.daemon.report.RoundReport): written once, as the JSON the
operations guide and the tests read (``state_dir/reports/<round>.json``: outcome, reason, plan,
classes_note, uploads, model, dp, evaluation...), parts not reached left out."""

from __future__ import annotations

import json
from pathlib import Path

from afl.client.daemon.report import RoundReport
from afl.client.daemon.state import DaemonState
from afl.client.modes.base import UploadRecord


def _record(slot: str, size: int) -> UploadRecord:
    return UploadRecord(slot, (slot,), size, "ab" * 32, 1, False, False, 0.5)


def test_a_refused_round_writes_what_was_reached_only(tmp_path: Path) -> None:
    report = RoundReport("site-1", "fed", "run-1", "r1-aaaa", 1, timings_s={"statistics": 2.0})
    report.plan = {"accepted": False, "reason": "policy"}
    report.outcome, report.reason, report.warnings = "REFUSED_PLAN", "policy", ["w"]
    path = DaemonState(tmp_path).write_report(report)
    assert path == tmp_path / "reports" / "r1-aaaa.json"
    assert json.loads(path.read_text()) == {
        "site_id": "site-1",
        "federation_id": "fed",
        "run_id": "run-1",
        "round_id": "r1-aaaa",
        "round_number": 1,
        "bytes_sent": 0,
        "bytes_received": 0,
        "timings_s": {"statistics": 2.0},
        "plan": {"accepted": False, "reason": "policy"},
        "outcome": "REFUSED_PLAN",
        "reason": "policy",
        "warnings": ["w"],
    }
    assert DaemonState(tmp_path).uploaded_rounds() == set()


def test_a_completed_round_writes_its_uploads_model_and_notes(tmp_path: Path) -> None:
    report = RoundReport("site-1", "fed", "run-1", "r1-bbbb", 1, transport="flower")
    report.classes_note = "class C is not in this site's cache"
    report.sent([_record("gram[all]", 100)])
    report.sent([_record("b[A]", 20), _record("b[B]", 20)])
    report.model = {"sha256": "cd" * 32}
    report.round_warnings = ["in-sample"]
    report.outcome, report.round_events_by_stream = "COMPLETED", 3
    doc = json.loads(DaemonState(tmp_path).write_report(report).read_text())
    assert doc["bytes_sent"] == 140
    assert [u["slot"] for u in doc["uploads"]] == ["gram[all]", "b[A]", "b[B]"]
    assert doc["uploads"][0]["already_complete"] is False
    assert doc["transport"] == "flower" and doc["classes_note"].startswith("class C")
    assert doc["model"] == {"sha256": "cd" * 32} and doc["round_warnings"] == ["in-sample"]
    assert doc["round_events_by_stream"] == 3
    assert report.verified and not RoundReport("s", "f", "r", "x", 1).verified
    assert DaemonState(tmp_path).completed_rounds() == {"r1-bbbb"}


def test_a_report_without_a_round_is_no_round_json(tmp_path: Path) -> None:
    path = DaemonState(tmp_path).write_report(RoundReport("site-1", "fed", "", "", 0))
    assert path.name == "no-round.json"
