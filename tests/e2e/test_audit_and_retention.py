"""M-30 and M-104 on a whole federation (docs/protocol.md §10, §11): afl-server and three
afl-client processes over loopback mutual TLS in MASK mode with ``evaluate = true`` (a training
round, then the evaluation round), payloads kept 30 days so that the finished state can be read.

* M-30: no record of the audit log, of any event the run produced, holds statistics or key
  material (:func:`tests.helpers.audit_scan.statistics_in_audit`: no array, no entry of a site's
  G_k or b_k, of their sums or of W, no blob, no private key);
* M-104: the retention purge of the finished run (the coordinator's own, at ``payload_days``)
  deletes the payload files AND the stored protocol messages of the secure mode (key adverts,
  sealed share bundles, consistency signatures, unmask responses), keeps the upload rows
  (digest, size), the model, the evaluation and the audit log, and records what it deleted;
* pseudonymisation (docs/compliance.md): no row id and no patient id of any site's cache appears
  in any file of the coordinator's state (database, WAL, payloads, models, evaluations).
"""

from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afl.crypto.identity import signatures
from afl.lab.demo.federation import prepare_labelled_everywhere, run_loopback
from afl.server.config import load_config
from afl.server.coordinator import Coordinator
from afl.server.store import DB_NAME, Store, kept_as_evidence
from tests.e2e.loopback import SiteData, cached_statistics
from tests.helpers.audit_scan import statistics_in_audit

CLASSES = ("A", "B")
DATA = SiteData(d=6, classes=2, rows=60, rows_step=10, positive_rate=0.4, seed=29)
SITES = 3
KEEP_DAYS = 30.0


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("compliance")
    feats, labels = DATA.draw(SITES)
    patients = [
        [f"patient-{k}-{i // 2:04d}-x7q" for i in range(len(f))] for k, f in enumerate(feats)
    ]
    loop = prepare_labelled_everywhere(
        root,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        test_rows=20,
        # mask bounds from the sites' declarations; the run ends with its evaluation round
        round_settings={"aggregation": "mask", "evaluate": True, "upload_timeout_s": 120.0},
        server_tables={"retention": {"payload_days": KEEP_DAYS}},
        site_patients=patients,
    )
    run = run_loopback(loop, timeout_s=300)
    assert run.client_rcs == dict.fromkeys(loop.site_ids, 0), run.logs
    return {
        "loop": loop,
        "run": run,
        "config": load_config(loop.server_config),
        "patients": patients,
    }


def _records(store: Store) -> list[tuple[str, dict[str, object]]]:
    return [(event, detail) for _, event, detail, *_ in store.audit_entries()]


def _raw_database(state: Path) -> bytes:
    return b"".join(
        (state / name).read_bytes()
        for name in (DB_NAME, f"{DB_NAME}-wal")
        if (state / name).exists()
    )


def _private_keys(finished: dict[str, Any]) -> list[bytes]:
    loop = finished["loop"]
    kits = [*(loop.provisioned.site_dirs[s] for s in loop.site_ids), loop.provisioned.server_dir]
    return [
        signatures.load_private_key_pem((kit / "identity.key").read_bytes()).private_bytes_raw()
        for kit in kits
    ]


def test_no_audit_record_of_a_finished_federation_holds_statistics(
    finished: dict[str, Any],
) -> None:
    loop, run, config = finished["loop"], finished["run"], finished["config"]
    store = Store(config.state_dir, federation_id=config.federation_id)
    try:
        records = _records(store)
    finally:
        store.close()
    events = {event for event, _ in records}
    # the record types of a whole run: enrolment, the run, its rounds and stages, the plan's
    # audit, publication and decisions, the masked uploads, the reports (the PUBLISHED stage
    # records carry the model's and the evaluation's digests)
    assert {
        "enrolled", "run-submitted", "run-started", "round-created", "stage", "plan-audit",
        "plan-published", "plan-decision", "upload", "client-report", "run-finished",
    } <= events, events  # fmt: skip
    stats = cached_statistics(loop, list(loop.site_ids))[0]
    arrays = [a for s in stats for a in (s.gram, s.b)]
    arrays += [np.sum([s.gram for s in stats], axis=0), np.sum([s.b for s in stats], axis=0)]
    (trained,) = [r for r in run.reports["site-1"].values() if "model" in r]
    arrays.append(np.load(trained["model"]["path"]))  # W
    secrets = _private_keys(finished)
    assert statistics_in_audit(records, statistics=arrays, secrets=secrets) == []
    # the scan sees what it looks for, in any record type
    planted: list[tuple[str, dict[str, object]]] = [
        ("stage", {"histogram": list(range(40))}),
        ("upload", {"site_id": "site-1", "note": float(stats[1].b[2, 0])}),
        ("dp-budget", {"key": secrets[0].hex()}),
        ("client-report", {"payload": "ab" * 64}),
    ]
    for record in planted:
        assert statistics_in_audit([record], statistics=arrays, secrets=secrets), record


def test_retention_deletes_the_payloads_and_the_protocol_messages_of_a_finished_run(
    finished: dict[str, Any], tmp_path: Path
) -> None:
    config = finished["config"]
    state = tmp_path / "state"
    shutil.copytree(config.state_dir, state)  # the module's state stays as the run left it
    config = replace(config, state_dir=state, payload_retention_days=KEEP_DAYS)
    store = Store(state, federation_id=config.federation_id)
    (run,) = store.runs()
    rounds = [r.round_id for r in store.rounds(run.run_id)]
    messages = {r: store.messages(r) for r in rounds}
    kinds = {m.kind for rows in messages.values() for m in rows}
    assert len(rounds) == 2 and all(messages.values()), kinds  # training and evaluation
    uploads = {r: store.uploads(r) for r in rounds}
    files = [row.path for rows in uploads.values() for row in rows.values()]
    assert files and all(p.is_file() for p in files)
    models = sorted((state / "models").iterdir()) + sorted((state / "evaluations").iterdir())

    # the messages a purge erases (signed statements are kept whole as evidence: M-162)
    bodies = [
        m.data
        for rows in messages.values()
        for m in rows
        if len(m.data) >= 64 and not kept_as_evidence(m.stage, m.kind)
    ]
    assert bodies and all(b in _raw_database(state) for b in bodies)  # before: they are there
    now = [run.finished_ms / 1000 + KEEP_DAYS * 86400 - 60]
    key = signatures.load_private_key_pem(config.identity_key.read_bytes())
    coordinator = Coordinator(config, store, key, clock=lambda: now[0])
    coordinator.tick()
    assert all(p.is_file() for p in files), "purged before payload_days"
    now[0] += 120
    coordinator.tick()
    try:
        assert not [p for p in files if p.exists()]
        assert not (state / "payloads").exists() or not any((state / "payloads").rglob("*"))
        assert all(store.messages(r) == [] for r in rounds)  # the protocol messages too
        for r in rounds:  # the rows stay: digest and size, marked purged
            assert {k: v.sha256 for k, v in store.uploads(r).items()} == {
                k: v.sha256 for k, v in uploads[r].items()
            }
        assert all(p.is_file() for p in models)
        deleted = [d for e, d in _records(store) if e == "payloads-deleted"]
        assert len(deleted) == 1 and deleted[0]["run_id"] == run.run_id
        assert deleted[0]["files"] == len(files)
        # what was deleted, by digest: every payload file and every protocol message (M-162)
        assert sorted(p["sha256"] for p in deleted[0]["payloads"]) == sorted(
            v.sha256.hex() for rows in uploads.values() for v in rows.values()
        )
        assert sorted(m["sha256"] for m in deleted[0]["messages"]) == sorted(
            hashlib.sha256(m.data).hexdigest() for rows in messages.values() for m in rows
        )
        assert statistics_in_audit(_records(store)) == []  # the purge's records too
        assert store.verify_audit_chain()
    finally:
        store.close()
    # SQLite's secure_delete: once the store is closed (checkpointed), no message body is left
    # in the database file or its WAL
    raw = _raw_database(state)
    assert not [b for b in bodies if b in raw]


def test_no_row_or_patient_id_reaches_the_coordinators_state(finished: dict[str, Any]) -> None:
    loop, config = finished["loop"], finished["config"]
    stored = b"".join(p.read_bytes() for p in sorted(config.state_dir.rglob("*")) if p.is_file())
    assert b"site-1" in stored  # the scan reads what the coordinator keeps (site ids are there)
    caches = cached_statistics(loop, list(loop.site_ids))[1]
    row_ids = [str(i) for cache in caches for i in cache.ids]
    assert all(re.fullmatch(r"site-\d+-\d+", i) for i in row_ids)  # the pattern searched below
    assert re.search(rb"site-\d+-\d+", stored) is None
    patients = {p for cache in caches for p in cache.patients or ()}
    assert patients == {p for rows in finished["patients"] for p in rows}
    assert not [p for p in patients if p.encode() in stored]
