"""`afl verify-log` (ops/verify_log.py, ops/verify_log_cmd.py): a log written by the real
:class:`afl.server.store.Store` verifies, and each kind of tampering is found at the right record,
in the SQLite database and in a JSON-lines export."""

from __future__ import annotations

import argparse
import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.ops import verify_log_cmd
from afl.ops.verify_log import (
    LogFormatError,
    chain_hash,
    export_jsonl,
    read_jsonl,
    read_log,
    read_sqlite,
    verify_chain,
)
from afl.server.store import Store

N_RECORDS = 6


def _state(tmp_path: Path) -> Path:
    """A server state dir whose audit log has N_RECORDS records written by the real Store."""
    state = tmp_path / "state"
    store = Store(state, federation_id="fed-v")
    for i in range(N_RECORDS):
        store.audit(f"event-{i}", {"round_id": "r1", "i": i, "eps": 0.5 * i, "site": f"s{i % 3}"})
    assert store.verify_audit_chain()
    store.close()
    return state


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    verify_log_cmd.add_arguments(parser)
    return verify_log_cmd.run(parser.parse_args(argv))


def _sql(state: Path, statement: str) -> None:
    db = sqlite3.connect(state / "server.sqlite3", isolation_level=None)
    db.execute(statement)
    db.close()


def test_clean_log_verifies_from_dir_db_and_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = _state(tmp_path)
    records = read_log(state)
    assert [r.seq for r in records] == list(range(1, N_RECORDS + 1))
    report = verify_chain(records)
    assert report.ok and report.records == N_RECORDS and report.head == records[-1].hash
    assert _cli([str(state / "server.sqlite3")]) == 0
    assert "OK: 6 records" in capsys.readouterr().out
    out = tmp_path / "audit.jsonl"
    assert _cli([str(state), "--export", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert read_jsonl(out) == records
    # The anchor printed now still holds after the log grows.
    anchor = ["--expect-head", report.head.hex(), "--expect-count", str(N_RECORDS)]
    store = Store(state, federation_id="fed-v")
    store.audit("later", {"x": 1})
    store.close()
    assert _cli([str(state), *anchor]) == 0


def test_independent_hash_oracle(tmp_path: Path) -> None:
    """chain_hash agrees with the store's formula written out by hand."""
    import hashlib
    import struct

    def field(tag: bytes, payload: bytes) -> bytes:
        return tag + struct.pack(">Q", len(payload)) + payload

    record = read_sqlite(_state(tmp_path) / "server.sqlite3")[0]
    stamp = record.time_ms.to_bytes((record.time_ms.bit_length() // 8) + 1, "big", signed=True)
    message = (
        struct.pack(">I", 3)
        + field(b"I", stamp)
        + field(b"S", record.event.encode())
        + field(b"S", record.detail.encode())
    )
    assert hashlib.sha256(b"\x00" * 32 + message).digest() == record.hash
    again = chain_hash(
        record.prev_hash, time_ms=record.time_ms, event=record.event, detail=record.detail
    )
    assert again == record.hash


def test_modified_record_in_sqlite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _state(tmp_path)
    _sql(state, """UPDATE audit_log SET detail = '{"i": 99}' WHERE seq = 3""")
    problem = verify_chain(read_log(state)).problem
    assert problem is not None and (problem.kind, problem.position, problem.seq) == (
        "modified",
        3,
        3,
    )
    assert _cli([str(state)]) == 1
    assert "TAMPERED: modified at record 3 (seq 3)" in capsys.readouterr().out


def test_modified_and_rehashed_record(tmp_path: Path) -> None:
    state = _state(tmp_path)
    rec = read_sqlite(state / "server.sqlite3")[2]
    forged = chain_hash(rec.prev_hash, time_ms=rec.time_ms, event=rec.event, detail='{"i": 0}')
    _sql(
        state,
        f"""UPDATE audit_log SET detail = '{{"i": 0}}', hash = X'{forged.hex()}' WHERE seq = 3""",
    )
    problem = verify_chain(read_log(state)).problem
    assert problem is not None and (problem.kind, problem.position) == ("modified", 3)


def test_deleted_record_in_sqlite(tmp_path: Path) -> None:
    state = _state(tmp_path)
    _sql(state, "DELETE FROM audit_log WHERE seq = 4")
    problem = verify_chain(read_log(state)).problem
    assert problem is not None and (problem.kind, problem.position, problem.seq) == (
        "deleted",
        4,
        5,
    )


def test_deleted_head_record(tmp_path: Path) -> None:
    state = _state(tmp_path)
    _sql(state, "DELETE FROM audit_log WHERE seq = 1")
    problem = verify_chain(read_log(state)).problem
    assert problem is not None and (problem.kind, problem.position) == ("deleted", 1)


def test_reordered_records_in_sqlite(tmp_path: Path) -> None:
    state = _state(tmp_path)
    _sql(state, "UPDATE audit_log SET seq = 100 WHERE seq = 2")
    _sql(state, "UPDATE audit_log SET seq = 2 WHERE seq = 3")
    _sql(state, "UPDATE audit_log SET seq = 3 WHERE seq = 100")
    problem = verify_chain(read_log(state)).problem
    assert problem is not None and (problem.kind, problem.position) == ("reordered", 2)


def test_truncated_tail_needs_the_anchor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = _state(tmp_path)
    head = verify_chain(read_log(state)).head
    _sql(state, f"DELETE FROM audit_log WHERE seq = {N_RECORDS}")
    assert verify_chain(read_log(state)).ok  # undetectable without an anchor (documented)
    assert _cli([str(state), "--expect-head", head.hex()]) == 1
    assert "truncated" in capsys.readouterr().out
    assert _cli([str(state), "--expect-count", str(N_RECORDS)]) == 1


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_any_tampering_of_an_export_is_found_at_its_record(tmp_path_factory, data) -> None:
    """Property: deleting, swapping or editing any line of the export is reported, and the
    reported position is the first record whose chain is broken."""
    tmp = tmp_path_factory.mktemp("v")
    records = read_log(_state(tmp))
    assert export_jsonl(records, tmp / "clean.jsonl") == N_RECORDS
    text = (tmp / "clean.jsonl").read_text().splitlines()
    kind = data.draw(st.sampled_from(["deleted", "reordered", "modified"]))
    i = data.draw(st.integers(0, N_RECORDS - 2))
    if kind == "deleted":
        del text[i]
        want = i + 1
    elif kind == "reordered":
        text[i], text[i + 1] = text[i + 1], text[i]
        want = i + 1
    else:
        obj = json.loads(text[i])
        obj["event"] = obj["event"] + "x"
        text[i] = json.dumps(obj)
        want = i + 1
    tampered = tmp / "t.jsonl"
    tampered.write_text("\n".join(text) + "\n")
    problem = verify_chain(read_jsonl(tampered)).problem
    assert problem is not None and problem.kind == kind and problem.position == want


def test_unreadable_inputs_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"seq": 1}\n')
    with pytest.raises(LogFormatError, match="time_ms"):
        read_jsonl(bad)
    assert _cli([str(bad)]) == 2
    assert _cli([str(tmp_path / "missing.db")]) == 2
    db = tmp_path / "other.sqlite3"
    sqlite3.connect(db).execute("CREATE TABLE t (x)").connection.close()
    assert _cli([str(db)]) == 2
    assert "not an afl-server state database" in capsys.readouterr().err
