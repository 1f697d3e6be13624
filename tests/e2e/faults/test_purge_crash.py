"""A coordinator killed inside the end-of-run purge, after its record and before its unlinks,
leaves no payload file once it restarts: the start-up sweep (``Store.sweep_payloads``, which
afl-server runs at every start) removes every file whose row says
purged and records what it removed in the audit log (docs/operations.md §8, docs/protocol.md
M-140)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from afl.server.store import Store
from tests.e2e.faults import purge_victim

HERE = Path(__file__).resolve().parent


def _payload_files(state_dir: Path) -> list[Path]:
    root = state_dir / "payloads"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []


def test_a_kill_between_the_purge_record_and_its_unlinks_leaves_no_payload_after_restart(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    proc = subprocess.run(
        [sys.executable, str(HERE / "purge_victim.py"), str(state)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = _payload_files(state)
    # The fault happened where it was meant to: every row says purged, every file is still there.
    assert len(left) == len(purge_victim.ROUNDS) * len(purge_victim.SITES)

    store = Store(state, federation_id=purge_victim.FEDERATION)
    try:
        assert store.sweep_payloads()  # what afl-server does at every start
        assert _payload_files(state) == []
        assert not (state / "payloads").exists() or not any((state / "payloads").iterdir())
        swept = [e for e in store.audit_entries() if e[1] == "payloads-swept"]
        assert len(swept) == 1
        removed = swept[0][2]["removed"]
        assert isinstance(removed, list)
        want = sorted(
            f"payloads/{r}/{s}/{hashlib.sha256(purge_victim.payload(r, s)).hexdigest()}.bin"
            for r in purge_victim.ROUNDS
            for s in purge_victim.SITES
        )
        assert sorted(removed) == want
        assert swept[0][2]["purged_rows"] == len(want)
        assert store.verify_audit_chain()
    finally:
        store.close()
    # A second start finds nothing more to sweep and writes no further record.
    again = Store(state, federation_id=purge_victim.FEDERATION)
    try:
        assert again.sweep_payloads() == []
        assert sum(e[1] == "payloads-swept" for e in again.audit_entries()) == 1
    finally:
        again.close()


def test_the_sweep_removes_an_upload_file_whose_row_was_never_committed(tmp_path: Path) -> None:
    """A crash between writing a payload file and committing its row (or a leftover .tmp)
    leaves a file no row names: the sweep erases it too (overwritten, then unlinked); files of
    live rows stay."""
    state = tmp_path / "state"
    store = Store(state, federation_id="fed")
    data = b"live statistics" * 10
    row = store.put_upload(
        "r1-x", "site-a", "gram", data=data, sha256=hashlib.sha256(data).digest()
    )
    store.close()
    orphan = state / "payloads" / "r1-x" / "site-b" / ("ab" * 32 + ".bin")
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"never committed")
    witness = tmp_path / "orphan-link"  # a hard link outside the folder shows the inode's bytes
    os.link(orphan, witness)
    leftover = row.path.with_name(row.path.name + ".tmp")
    leftover.write_bytes(b"half")
    reopened = Store(state, federation_id="fed")
    try:
        assert sorted(reopened.sweep_payloads()) == sorted(
            str(p.relative_to(state)) for p in (orphan, leftover)
        )
        assert row.path.read_bytes() == data
        assert not orphan.parent.exists()
        assert witness.read_bytes() == bytes(len(b"never committed"))  # overwritten (M-175)
    finally:
        reopened.close()
