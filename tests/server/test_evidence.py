"""What the coordinator keeps as evidence past the payload purge (docs/protocol.md M-162, M-163):
the signed plan decisions, the digest of every deleted payload and message, and the bytes of
the messages that are signed statements or public keys only; never a statistic, masked or
encrypted sum or secret share. A state written before consents were kept gains the column."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path
from typing import cast

from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.store import Store

ROUND = "r1-abc"
#: (stage, site, kind, data, kept whole?)
MESSAGES = [
    (pb.ROUND_STAGE_PLAN_REVIEW, "s1", "plan-decision", b"signed decision", True),
    (pb.ROUND_STAGE_ADVERTISE_KEYS, "s1", "mask", b"advert: public keys, signature", True),
    (pb.ROUND_STAGE_SHARE_KEYS, "s1", "mask", b"encrypted shares", False),
    (pb.ROUND_STAGE_CONSISTENCY_CHECK, "s1", "mask", b"consistency signature", True),
    (pb.ROUND_STAGE_UNMASK, "s1", "mask", b"secret seed shares", False),
    (pb.ROUND_STAGE_UPLOAD, "s2", "ckks-tags", b"sealed tags", False),
    (pb.ROUND_STAGE_SOLVING, "dec", "ckks-result:gram[all]", b"decrypted sum", False),
    (pb.ROUND_STAGE_SOLVING, "dec", "ckks-outcome:gram[all]", b"signed outcome", True),
]


def test_a_purge_keeps_digests_and_signed_evidence_only(tmp_path: Path) -> None:
    store = Store(tmp_path, federation_id="fed")
    decision = pb.PlanDecision(round_id=ROUND, accept=True, signature=b"s" * 64)
    store.put_decision(
        ROUND,
        "s1",
        accept=True,
        reason="",
        signed=decision.SerializeToString(),
        audit={"round_id": ROUND, "site_id": "s1"},
    )
    for stage, site, kind, data, _ in MESSAGES:
        store.put_message(ROUND, stage=stage, site_id=site, kind=kind, data=data)
    stored = store.put_upload(
        ROUND, "s1", "gram[all]", data=b"G", sha256=hashlib.sha256(b"G").digest()
    )
    assert store.purge_payloads([ROUND], audit={"run_id": "run-1"}) == 1
    assert not stored.path.exists() and store.messages(ROUND) == []
    kept = store.evidence(ROUND)
    assert [(e.stage, e.site_id, e.kind) for e in kept] == [m[:3] for m in MESSAGES]
    for row, (_, _, _, data, whole) in zip(kept, MESSAGES, strict=True):
        assert row.sha256 == hashlib.sha256(data).digest()
        assert row.data == (data if whole else None)
    assert store.signed_decisions(ROUND) == {"s1": decision.SerializeToString()}
    records = {event: detail for _, event, detail, _, _ in store.audit_entries()}
    assert (
        records["plan-decision"]["sha256"]
        == hashlib.sha256(decision.SerializeToString()).hexdigest()
    )
    deleted = records["payloads-deleted"]
    assert deleted["run_id"] == "run-1" and deleted["files"] == 1
    assert deleted["payloads"] == [
        {"round_id": ROUND, "site_id": "s1", "release": "gram[all]", "sha256": stored.sha256.hex()}
    ]
    messages = cast(list[dict[str, str]], deleted["messages"])
    assert [m["sha256"] for m in messages] == [hashlib.sha256(m[3]).hexdigest() for m in MESSAGES]
    assert "secret seed shares" not in json.dumps(records)
    store.close()


def test_a_state_from_before_consents_gains_the_signature_column(tmp_path: Path) -> None:
    Store(tmp_path, federation_id="fed").close()
    db = sqlite3.connect(tmp_path / "server.sqlite3")
    db.executescript(
        "DROP TABLE decisions; CREATE TABLE decisions (round_id TEXT NOT NULL, site_id TEXT NOT "
        "NULL, accept INTEGER NOT NULL, reason TEXT NOT NULL, PRIMARY KEY (round_id, site_id));"
        "INSERT INTO decisions VALUES ('r0', 's1', 1, '');"
    )
    db.close()
    store = Store(tmp_path, federation_id="fed")
    assert store.decisions("r0") == {"s1": (True, "")} and store.signed_decisions("r0") == {}
    store.put_decision(ROUND, "s1", accept=True, reason="", signed=b"kept")
    assert store.signed_decisions(ROUND) == {"s1": b"kept"}
