"""One upload per round, ever (afl.client.policy.uploads, docs/protocol.md M-200..M-202): the
register is on disk before anything leaves, a round sent before is refused whatever the
coordinator now holds, and an interrupted exchange resumes with the bytes of its first claim,
never with bytes computed again (fresh DP noise)."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest

from afl.client.payloads.stats import SlotPayload
from afl.client.policy.uploads import UploadRegister, UploadRegisterError

PLAN = "ab" * 32


def _payload(slot: str, data: bytes) -> SlotPayload:
    return SlotPayload(slot, (slot,), data, hashlib.sha256(data).hexdigest())


FIRST = [_payload("gram[all]", b"first noise G"), _payload("b[A]", b"first noise b")]
FRESH = [_payload("gram[all]", b"other noise G"), _payload("b[A]", b"other noise b")]


def _claim(
    register: UploadRegister, payloads: list[SlotPayload], **kw: object
) -> list[SlotPayload]:
    fields: dict[str, object] = {
        "federation_id": "fed",
        "run_id": "run-1",
        "round_id": "r1",
        "round_number": 1,
        "plan_sha256": PLAN,
        "aggregation": "AGGREGATION_MODE_PLAINTEXT",
        "payloads": payloads,
        **kw,
    }
    return register.claim(**fields)  # type: ignore[arg-type]


def test_the_claim_is_on_disk_with_the_exact_bytes_before_it_returns(tmp_path: Path) -> None:
    register = UploadRegister(tmp_path / "uploads")
    assert register.get("r1") is None and register.rounds() == set()
    assert _claim(register, FIRST) == FIRST
    path = tmp_path / "uploads" / "r1.json"
    doc = json.loads(path.read_text())
    assert (doc["federation_id"], doc["run_id"], doc["round_id"]) == ("fed", "run-1", "r1")
    assert doc["plan_sha256"] == PLAN and doc["sent_unix_ms"] == 0
    assert [(s["slot"], s["sha256"]) for s in doc["slots"]] == [(p.slot, p.sha256) for p in FIRST]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    kept = sorted((tmp_path / "uploads" / "r1").iterdir())
    assert [p.read_bytes() for p in kept] == [p.payload for p in FIRST]
    assert UploadRegister(tmp_path / "uploads").rounds() == {"r1"}  # a restarted site sees it


def test_an_interrupted_exchange_resumes_with_the_first_bytes_never_fresh_ones(
    tmp_path: Path,
) -> None:
    register = UploadRegister(tmp_path / "uploads")
    _claim(register, FIRST)
    again = UploadRegister(tmp_path / "uploads")  # the site restarted mid-exchange
    assert again.refusal("r1", already_complete={"gram[all]"}, plan_sha256=PLAN) == ""
    resumed = _claim(again, FRESH)
    assert [p.payload for p in resumed] == [p.payload for p in FIRST]
    assert [p.sha256 for p in resumed] == [p.sha256 for p in FIRST]


def test_a_round_sent_before_is_refused_once_the_coordinator_lacks_it(tmp_path: Path) -> None:
    register = UploadRegister(tmp_path / "uploads")
    _claim(register, FIRST)
    record = register.finish("r1")
    assert record.sent and not (tmp_path / "uploads" / "r1").exists()  # the bytes are gone
    register = UploadRegister(tmp_path / "uploads")
    # A coordinator restored from a copy taken before the uploads holds none of them.
    why = register.refusal("r1", already_complete=(), plan_sha256=PLAN)
    assert "\n" not in why
    assert "round r1 is offered again" in why and "run run-1" in why and "sent" in why
    assert "gram[all]" in why and "b[A]" in why and "once" in why
    assert register.refusal("r1", already_complete={"gram[all]"}) != ""  # one slot is enough
    # The coordinator holds everything: nothing would leave again (a restarted site).
    assert register.refusal("r1", already_complete={"gram[all]", "b[A]"}, plan_sha256=PLAN) == ""
    held = _claim(register, FRESH)
    assert [p.payload for p in held] == [b"", b""]  # never the fresh bytes


def test_another_plan_of_the_round_and_a_begun_masked_exchange_are_refused(
    tmp_path: Path,
) -> None:
    register = UploadRegister(tmp_path / "uploads")
    _claim(register, FIRST, keep_bytes=False)
    other = "cd" * 32
    why = register.refusal("r1", already_complete=(), plan_sha256=other)
    assert "another plan" in why and "one plan" in why
    with pytest.raises(UploadRegisterError, match="another plan"):
        _claim(register, FIRST, plan_sha256=other)
    masked = register.refusal("r1", already_complete=(), plan_sha256=PLAN, resumable=False)
    assert "never resumed" in masked


def test_a_report_from_before_the_register_still_counts_and_a_new_round_passes(
    tmp_path: Path,
) -> None:
    register = UploadRegister(tmp_path / "uploads")
    assert register.refusal("r2", already_complete=()) == ""
    assert "report" in register.refusal("r2", already_complete=(), reported={"r2"})


def test_kept_bytes_that_do_not_match_their_record_are_not_sent(tmp_path: Path) -> None:
    register = UploadRegister(tmp_path / "uploads")
    _claim(register, FIRST)
    (tmp_path / "uploads" / "r1" / "0.bin").write_bytes(b"changed")
    with pytest.raises(UploadRegisterError, match="does not match"):
        _claim(register, FIRST)
