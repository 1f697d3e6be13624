"""The coordinator's state never silently rolls back (docs/architecture.md §8): a deleted or
truncated WAL, a missing database, a deleted or resized payload and a corrupted database are each
a one-line refusal to start (exit 2); a payload corrupted in place aborts its round with the
reason; a backup restores; a schema-1 state folder is migrated; a full disk is
RESOURCE_EXHAUSTED; a finished run's payloads are deleted per the retention setting."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from afl.core import erase as erase_module
from afl.crypto.identity import signatures
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.wire import AssembledPayload
from afl.server import store as store_module
from afl.server.config import load_config
from afl.server.coordinator import Coordinator
from afl.server.errors import DiskFullError, StateError, WrongStageError
from afl.server.servicer import status_for
from afl.server.store import ANCHOR_NAME, DB_NAME, Store, backup_state
from tests.helpers.erasing import refuse_erasing
from tests.helpers.federation import FederationSpec
from tests.helpers.inprocess import accept_plan, enrol

SITES = ["p1", "p2", "p3"]
FEDERATION = FederationSpec(
    sites=SITES,
    round_settings={"classes": ["a"], "feature_dim": 2, "min_participants": 3},
)

_WRITER = """
import sys
from pathlib import Path
from afl.server.store import Store
store = Store(Path(sys.argv[1]), federation_id="fed")
for i in range(int(sys.argv[2])):
    store.audit("event", {"i": i})
import os
os._exit(0)  # like a killed server: the WAL is never checkpointed
"""


def _written_state(tmp_path: Path, records: int = 40) -> Path:
    """A state folder left by a killed process, its last commits still in the WAL."""
    state = tmp_path / "state"
    subprocess.run([sys.executable, "-c", _WRITER, str(state), str(records)], check=True)
    assert (state / f"{DB_NAME}-wal").stat().st_size > 0
    return state


def test_a_deleted_wal_is_a_rollback_and_is_refused(tmp_path: Path) -> None:
    state = _written_state(tmp_path)
    (state / f"{DB_NAME}-wal").unlink()
    (state / f"{DB_NAME}-shm").unlink(missing_ok=True)
    with pytest.raises(StateError, match="rolled back"):
        Store(state, federation_id="fed")


def test_a_truncated_wal_is_refused_and_verify_log_reports_it(tmp_path: Path) -> None:
    state = _written_state(tmp_path)
    wal = state / f"{DB_NAME}-wal"
    with open(wal, "r+b") as handle:
        handle.truncate(wal.stat().st_size // 2)
    with pytest.raises(StateError, match=r"rolled back|does not pass through"):
        Store(state, federation_id="fed")
    proc = subprocess.run(
        [sys.executable, "-m", "afl.lab.cli", "verify-log", str(state)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "TAMPERED: truncated" in proc.stdout, proc.stdout + proc.stderr


def test_intact_state_reopens_and_keeps_its_anchor(tmp_path: Path) -> None:
    state = _written_state(tmp_path, records=10)
    store = Store(state, federation_id="fed")
    anchor = json.loads((state / ANCHOR_NAME).read_text())
    assert anchor["audit_count"] == 10 and store.verify_audit_chain()
    store.close()


def test_a_missing_database_with_an_anchor_is_refused(tmp_path: Path) -> None:
    state = _written_state(tmp_path, records=3)
    for suffix in ("", "-wal", "-shm"):
        (state / f"{DB_NAME}{suffix}").unlink(missing_ok=True)
    with pytest.raises(StateError, match="is missing but"):
        Store(state, federation_id="fed")


def test_a_corrupted_database_is_refused(tmp_path: Path) -> None:
    state = _written_state(tmp_path, records=200)
    Store(state, federation_id="fed").close()  # checkpoint into the main file
    db = state / DB_NAME
    data = bytearray(db.read_bytes())
    for offset in range(4096, len(data), 4096):  # scramble every page but the header
        data[offset + 100 : offset + 200] = os.urandom(100)
    db.write_bytes(bytes(data))
    for suffix in ("-wal", "-shm"):
        (state / f"{DB_NAME}{suffix}").unlink(missing_ok=True)
    with pytest.raises(StateError):
        Store(state, federation_id="fed")


def _payload_state(tmp_path: Path) -> tuple[Path, Path]:
    store = Store(tmp_path / "state", federation_id="fed")
    row = store.put_upload(
        "r1", "p1", "b[a]", data=b"x" * 64, sha256=hashlib.sha256(b"x" * 64).digest()
    )
    store.close()
    return tmp_path / "state", row.path


def test_an_upload_and_its_audit_record_commit_together(tmp_path: Path) -> None:
    """One transaction (one commit, one anchor write) holds the upload row and its audit record:
    both are on disk when put_upload returns, and neither when the record cannot be written."""
    store = Store(tmp_path / "state", federation_id="fed")

    def count(of: Store, key: str) -> int:
        value = of.anchor()[key]
        assert isinstance(value, int)
        return value

    commits, audits = count(store, "commits"), count(store, "audit_count")
    data = b"y" * 64
    detail = {"round_id": "r1", "site_id": "p1", "release": "b[a]", "bytes": len(data)}
    store.put_upload(
        "r1", "p1", "b[a]", data=data, sha256=hashlib.sha256(data).digest(), audit=detail
    )
    assert count(store, "commits") == commits + 1
    assert count(store, "audit_count") == audits + 1
    store.close()
    reopened = Store(tmp_path / "state", federation_id="fed")
    assert set(reopened.uploads("r1")) == {("p1", "b[a]")}
    assert reopened.audit_entries()[-1][1:3] == ("upload", detail)
    assert reopened.verify_audit_chain()
    with pytest.raises(TypeError):  # a detail JSON cannot hold: the row is rolled back too
        reopened.put_upload(
            "r1", "p2", "b[a]", data=data, sha256=hashlib.sha256(data).digest(), audit={"x": {1j}}
        )
    assert set(reopened.uploads("r1")) == {("p1", "b[a]")}
    assert count(reopened, "commits") == commits + 1
    reopened.close()


def test_a_deleted_or_resized_payload_is_refused(tmp_path: Path) -> None:
    state, payload = _payload_state(tmp_path)
    payload.write_bytes(b"x" * 10)
    with pytest.raises(StateError, match="holds 10 bytes"):
        Store(state, federation_id="fed")
    payload.unlink()
    with pytest.raises(StateError, match="is missing"):
        Store(state, federation_id="fed")


def test_the_daemon_refuses_in_one_line_with_exit_2(federation: Any, tmp_path: Path) -> None:
    config = federation.server_dir / "server.toml"
    state = federation.server_dir / "state"
    proc = subprocess.run(
        [sys.executable, "-c", _WRITER, str(state), "5"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    fed = load_config(config).federation_id
    db = sqlite3.connect(state / DB_NAME)  # the writer used another federation id: fix it up
    db.execute("UPDATE meta SET value = ? WHERE key = 'federation_id'", (fed,))
    db.commit()
    db.close()
    anchor = json.loads((state / ANCHOR_NAME).read_text())
    anchor["federation_id"] = fed
    anchor["commits"] = int(anchor["commits"]) + 100  # the database is 100 commits behind
    (state / ANCHOR_NAME).write_text(json.dumps(anchor))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "afl.server.daemon.main",
            "--config",
            str(config),
            "--listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "rolled back" in lines[0] and "Traceback" not in out.stderr


# --- the coordinator ----------------------------------------------------------------------------


def _coordinator(federation: Any, state: Path, **settings: Any) -> Coordinator:
    config = load_config(federation.server_dir / "server.toml")
    config = replace(config, state_dir=state, round=replace(config.round, **settings))
    key = signatures.load_private_key_pem((federation.server_dir / "identity.key").read_bytes())
    return Coordinator(config, Store(state, federation_id=config.federation_id), key)


def _upload(coordinator: Coordinator, site: str, round_id: str, name: str, data: bytes) -> Any:
    digest = hashlib.sha256(data).digest()
    return coordinator.upload(
        site, AssembledPayload(round_id, name, pb.PAYLOAD_KIND_STATISTIC, data, digest)
    )


def test_a_payload_corrupted_in_place_aborts_the_round_with_the_reason(
    federation: Any, tmp_path: Path
) -> None:
    coordinator = _coordinator(federation, tmp_path / "state")
    for site in SITES:
        enrol(coordinator, federation, site)
    view = coordinator.find("")
    for site in SITES:
        accept_plan(coordinator, federation, site, view)
    view = coordinator.find("")
    values = {r.name: bytes(8 * r.length) for r in view.releases}
    for site in SITES[:-1]:
        for name, data in values.items():
            _upload(coordinator, site, view.round_id, name, data)
    stored = coordinator.store.uploads(view.round_id)[(SITES[0], "gram[all]")]
    stored.path.write_bytes(b"\x01" * stored.size)  # same size, other content
    for name, data in values.items():
        _upload(coordinator, SITES[-1], view.round_id, name, data)
    row = coordinator.store.rounds()[-1]
    assert row.stage == pb.ROUND_STAGE_ABORTED
    assert "does not match its recorded digest" in row.abort_reason
    assert coordinator.store.runs()[-1].state == "aborted"


def test_a_full_disk_is_resource_exhausted_with_a_reason(
    federation: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator = _coordinator(federation, tmp_path / "state")
    for site in SITES:
        enrol(coordinator, federation, site)
    view = coordinator.find("")
    accept_plan(coordinator, federation, SITES[0], view)

    def full(*args: Any, **kw: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "write_private_file", full)
    release = coordinator.find("").releases[0]
    with pytest.raises(DiskFullError, match="disk is full") as info:
        _upload(coordinator, SITES[0], view.round_id, release.name, bytes(8 * release.length))
    assert status_for(info.value)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert coordinator.store.uploads(view.round_id) == {}


def test_an_uploads_file_is_written_while_other_calls_can_take_the_lock(
    federation: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The payload file (written and fsynced: an upload's slow part) is staged before the
    coordinator's lock is taken and moved into place under it (the same inode: not written
    again); an upload the round's state refuses writes nothing, and a retry of a stored one
    leaves no staged file behind."""
    coordinator = _coordinator(federation, tmp_path / "state")
    for site in SITES:
        enrol(coordinator, federation, site)
    view = coordinator.find("")
    release = view.releases[0]
    data = bytes(8 * release.length)
    folder = tmp_path / "state" / "payloads" / view.round_id
    stage, lock_free, inodes = coordinator.store.stage_payload, [], []

    def take_the_lock() -> None:  # another call, in another thread
        taken = coordinator.lock.acquire(timeout=30)
        lock_free.append(taken)
        if taken:
            coordinator.lock.release()

    def observed_stage(*args: Any, **kw: Any) -> Path:
        other = threading.Thread(target=take_the_lock)
        other.start()
        other.join()
        staged = stage(*args, **kw)
        inodes.append(staged.stat().st_ino)
        return staged

    monkeypatch.setattr(coordinator.store, "stage_payload", observed_stage)
    with pytest.raises(WrongStageError, match="accept the release plan"):
        _upload(coordinator, SITES[0], view.round_id, release.name, data)  # before accepting
    assert lock_free == [] and not folder.exists()  # refused before anything was written
    accept_plan(coordinator, federation, SITES[0], view)
    receipt = _upload(coordinator, SITES[0], view.round_id, release.name, data)
    final = folder / SITES[0] / f"{hashlib.sha256(data).hexdigest()}.bin"
    assert lock_free == [True] and final.stat().st_ino == inodes[0]  # renamed, not rewritten
    again = _upload(coordinator, SITES[0], view.round_id, release.name, data)  # a retry
    assert not receipt.duplicate and again.duplicate and lock_free == [True]  # nothing staged
    assert sorted(p for p in folder.rglob("*") if p.is_file()) == [final]


def test_a_staged_upload_whose_commit_fails_leaves_no_file(
    federation: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A payload file renamed into place whose row then fails to commit is erased (no row
    names it); the site can retry the upload. Staging survives the eraser removing the emptied
    folder between the folder's creation and the file's."""
    coordinator = _coordinator(federation, tmp_path / "state")
    for site in SITES:
        enrol(coordinator, federation, site)
    view = coordinator.find("")
    accept_plan(coordinator, federation, SITES[0], view)
    release = view.releases[0]
    data = bytes(8 * release.length)
    folder = tmp_path / "state" / "payloads" / view.round_id
    append_audit = store_module.Store._append_audit

    def failing_audit(db: Any, event: str, detail: Any) -> None:
        if event == "upload":
            raise sqlite3.OperationalError("disk I/O error")
        append_audit(db, event, detail)

    monkeypatch.setattr(store_module.Store, "_append_audit", staticmethod(failing_audit))
    with pytest.raises(sqlite3.OperationalError):
        _upload(coordinator, SITES[0], view.round_id, release.name, data)
    assert not [p for p in folder.rglob("*") if p.is_file()]
    assert coordinator.store.uploads(view.round_id) == {}
    monkeypatch.setattr(store_module.Store, "_append_audit", staticmethod(append_audit))
    write = getattr(store_module, "write_private_file")  # noqa: B009 (not exported)
    removed: list[Path] = []

    def folder_gone_once(path: Any, data: bytes) -> Path:
        if not removed:  # the eraser's tidy removed the emptied folder meanwhile
            removed.append(Path(path).parent)
            Path(path).parent.rmdir()
        return Path(write(path, data))

    monkeypatch.setattr(store_module, "write_private_file", folder_gone_once)
    receipt = _upload(coordinator, SITES[0], view.round_id, release.name, data)
    assert removed and not receipt.duplicate
    assert (folder / SITES[0] / f"{hashlib.sha256(data).hexdigest()}.bin").read_bytes() == data


def test_a_failed_commit_keeps_the_file_another_release_of_the_same_bytes_names(
    federation: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two releases of one site with the same bytes share their payload file; when the second
    one's row fails to commit, the first one's file stays."""
    store = Store(tmp_path / "state", federation_id="fed")
    data = b"the same statistics" * 8
    digest = hashlib.sha256(data).digest()
    first = store.put_upload("r1-x", "site-a", "b[A]", data=data, sha256=digest)
    staged = store.stage_payload("r1-x", "site-a", data=data, sha256=digest)
    append_audit = store_module.Store._append_audit

    def failing_audit(db: Any, event: str, detail: Any) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(store_module.Store, "_append_audit", staticmethod(failing_audit))
    with pytest.raises(sqlite3.OperationalError):
        store.put_upload(
            "r1-x", "site-a", "b[B]", data=data, sha256=digest, audit={}, staged=staged
        )
    monkeypatch.setattr(store_module.Store, "_append_audit", staticmethod(append_audit))
    assert first.path.read_bytes() == data and not staged.exists()
    assert list(store.uploads("r1-x")) == [("site-a", "b[A]")]
    store.close()


def test_the_coordinator_retries_a_failed_erasure_at_the_minutes_tick(
    federation: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default retention (payloads erased when the run ends), a file the background
    eraser could not erase is tried again by the coordinator's tick, a minute on."""
    refusing = refuse_erasing(monkeypatch)
    now = [1_000_000.0]
    config = load_config(federation.server_dir / "server.toml")
    config = replace(config, state_dir=tmp_path / "state", payload_retention_days=0.0)
    assert config.report_retention_days is None  # the default: purge_due never runs
    coordinator, view = _published_run(federation, config, now, background_erase=True)
    folder = config.state_dir / "payloads" / view.round_id
    assert coordinator.store.drain_erasures(timeout_s=60)
    left = sorted(folder.rglob("*.bin"))
    assert left  # the eraser failed on every file
    refusing[0] = False
    now[0] += 61
    coordinator.tick()
    assert coordinator.store.drain_erasures(timeout_s=60)
    assert not [p for p in left if p.exists()]
    coordinator.store.close()


def _published_run(
    federation: Any, config: Any, now: list[float], **store_options: Any
) -> tuple[Coordinator, Any]:
    """A coordinator on ``config`` (its store opened with ``store_options``) whose clock reads
    ``now[0]``, and the round of its run, which every site accepted and uploaded to
    (published)."""
    key = signatures.load_private_key_pem((federation.server_dir / "identity.key").read_bytes())
    store = Store(config.state_dir, federation_id=config.federation_id, **store_options)
    coordinator = Coordinator(config, store, key, clock=lambda: now[0])
    for site in SITES:
        enrol(coordinator, federation, site)
    view = coordinator.find("")
    for site in SITES:
        accept_plan(coordinator, federation, site, view)
    for site in SITES:
        for release in coordinator.find("").releases:
            _upload(coordinator, site, view.round_id, release.name, bytes(8 * release.length))
    assert store.runs()[0].state == "published"
    return coordinator, view


@pytest.mark.parametrize("days", [0.0, 7.0])
def test_payloads_of_a_finished_run_follow_the_retention_setting(
    federation: Any, tmp_path: Path, days: float
) -> None:
    now = [1_000_000.0]
    config = load_config(federation.server_dir / "server.toml")
    config = replace(config, state_dir=tmp_path / "state", payload_retention_days=days)
    coordinator, view = _published_run(federation, config, now)
    folder = config.state_dir / "payloads" / view.round_id
    assert folder.exists() == (days > 0)
    now[0] += days * 86400 + 120
    coordinator.tick()
    assert not folder.exists()
    entries = [e for _, e, *_ in coordinator.store.audit_entries()]
    assert "payloads-deleted" in entries


def test_the_daemons_store_erases_a_finished_runs_payloads_after_the_call_that_ended_it(
    federation: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``background_erase`` (afl-server's store) the last upload, which publishes the round
    and ends the run, returns with the purge's intent committed (rows purged, the audit record)
    while the files are still being erased: the coordinator's lock is not held for the disk.
    Closing the store waits for the erasure (M-140)."""
    gate, erased = threading.Event(), []

    def slow_erase(path: Path, *, evidence: bool = True) -> dict[str, object]:
        gate.wait(60)
        erased.append(path)
        return real_erase(path, evidence=evidence)

    real_erase = erase_module.erase_file
    monkeypatch.setattr(erase_module, "erase_file", slow_erase)
    config = load_config(federation.server_dir / "server.toml")
    config = replace(config, state_dir=tmp_path / "state", payload_retention_days=0.0)
    coordinator, view = _published_run(federation, config, [1_000_000.0], background_erase=True)
    store = coordinator.store
    folder = config.state_dir / "payloads" / view.round_id
    files = sorted(p for p in folder.rglob("*.bin"))
    assert files and erased == []  # the run ended; nothing erased yet
    entries = [e for _, e, *_ in store.audit_entries()]
    assert "payloads-deleted" in entries
    assert store.drain_erasures(timeout_s=0.1) is False
    gate.set()
    store.close()  # waits for the eraser
    assert sorted(erased) == files and not folder.exists()


def test_a_backup_of_a_running_state_restores_elsewhere(federation: Any, tmp_path: Path) -> None:
    coordinator = _coordinator(federation, tmp_path / "state")
    for site in SITES:
        enrol(coordinator, federation, site)
    view = coordinator.find("")
    accept_plan(coordinator, federation, SITES[0], view)
    release = coordinator.find("").releases[0]
    _upload(coordinator, SITES[0], view.round_id, release.name, bytes(8 * release.length))
    anchor = backup_state(tmp_path / "state", tmp_path / "copy")
    coordinator.store.audit("after-the-backup", {})  # the live server goes on
    restored = Store(tmp_path / "copy", federation_id=coordinator.config.federation_id)
    assert int(str(anchor["audit_count"])) == len(restored.audit_entries())
    uploads = restored.uploads(view.round_id)
    assert restored.read_payload(uploads[(SITES[0], release.name)]) == bytes(8 * release.length)
    with pytest.raises(StateError, match="not empty"):
        backup_state(tmp_path / "state", tmp_path / "copy")


_V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE enrolments (site_id TEXT PRIMARY KEY, identity_public_key BLOB NOT NULL,
    role TEXT NOT NULL, labelled_classes TEXT NOT NULL, backbone TEXT NOT NULL,
    feature_dim INTEGER NOT NULL, software_version TEXT NOT NULL, enrolled_ms INTEGER NOT NULL);
CREATE TABLE rounds (ordinal INTEGER PRIMARY KEY AUTOINCREMENT, round_id TEXT UNIQUE NOT NULL,
    number INTEGER NOT NULL, parent_round_id TEXT NOT NULL, stage INTEGER NOT NULL,
    participants TEXT NOT NULL, plan BLOB, plan_signature BLOB, deadline_ms INTEGER NOT NULL,
    abort_reason TEXT NOT NULL DEFAULT '', created_ms INTEGER NOT NULL);
CREATE TABLE uploads (round_id TEXT NOT NULL, site_id TEXT NOT NULL, release_name TEXT NOT NULL,
    sha256 BLOB NOT NULL, size INTEGER NOT NULL, path TEXT NOT NULL, received_ms INTEGER NOT NULL,
    PRIMARY KEY (round_id, site_id, release_name));
"""


def test_a_schema_1_state_becomes_the_first_run(federation: Any, tmp_path: Path) -> None:
    config = load_config(federation.server_dir / "server.toml")
    state = tmp_path / "state"
    state.mkdir()
    db = sqlite3.connect(state / DB_NAME)
    db.executescript(_V1_SCHEMA)
    db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    db.execute("INSERT INTO meta VALUES ('federation_id', ?)", (config.federation_id,))
    db.execute(
        "INSERT INTO rounds (round_id, number, parent_round_id, stage, participants, deadline_ms, "
        "abort_reason, created_ms) VALUES ('r1-old', 1, '', ?, ?, 0, 'refused', 0)",
        (pb.ROUND_STAGE_ABORTED, json.dumps(SITES)),
    )
    db.commit()
    db.close()
    coordinator = _coordinator(federation, state)
    runs = coordinator.store.runs()
    assert runs[0].state == "aborted" and runs[0].reason == "refused"
    assert coordinator.store.rounds("run-1")[0].round_id == "r1-old"


def test_reports_of_a_finished_run_are_erased_after_reports_days_with_their_digests(
    federation: Any, tmp_path: Path
) -> None:
    """M-174: ``[retention] reports_days`` erases the sites' round reports of a run that ended
    that long ago; one "reports-deleted" audit record lists each by the SHA-256 computed here,
    the chain still verifies, and no byte of them stays in the database files."""
    now = [1_000_000.0]
    config = load_config(federation.server_dir / "server.toml")
    config = replace(config, state_dir=tmp_path / "state", report_retention_days=7.0)
    coordinator, view = _published_run(federation, config, now)
    store = coordinator.store
    reports = {site: f"round report of {site}: MARKER-{site}-0123456789".encode() for site in SITES}
    for site, report in reports.items():
        store.put_report(view.round_id, site, report, audit={"site_id": site})
    database = [config.state_dir / DB_NAME, config.state_dir / f"{DB_NAME}-wal"]

    def on_disk(marker: bytes) -> bool:
        return any(marker in p.read_bytes() for p in database if p.exists())

    assert on_disk(b"MARKER-" + SITES[0].encode())
    now[0] += 6 * 86400
    coordinator.tick()
    assert store.reports(view.round_id) == reports  # not yet 7 days
    now[0] += 86400 + 120
    coordinator.tick()
    assert store.reports(view.round_id) == {}
    (detail,) = [d for _, event, d, *_ in store.audit_entries() if event == "reports-deleted"]
    assert detail["reports"] == [
        {"round_id": view.round_id, "site_id": s, "sha256": hashlib.sha256(r).hexdigest()}
        for s, r in sorted(reports.items())
    ]
    assert store.verify_audit_chain()
    assert not any(on_disk(b"MARKER-" + s.encode()) for s in SITES)  # secure_delete + VACUUM
