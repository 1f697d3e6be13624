"""Offboarding and secure deletion at the coordinator (docs/operations.md §10, docs/protocol.md
M-175, M-176): a site's payload files, protocol messages, reports and declarations are deleted
with a "site-offboarded" audit record listing their SHA-256 digests (computed here from the bytes
stored, the oracle), the other sites' data stays, and no deleted byte is left anywhere in the
state folder: not in the database, not in its WAL, not in a payload file. A retention purge
leaves no message bytes behind either. `afl-server offboard` refuses while the server runs."""

from __future__ import annotations

import hashlib
import logging
import socket
import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from afl.lab.demo.federation import free_port
from afl.ops.provisioning import ProvisionedFederation
from afl.server import store as store_module
from afl.server.config import load_config
from afl.server.daemon.main import _offboard
from afl.server.errors import ConfigError
from afl.server.store import Store
from tests.helpers.federation import FederationSpec

FEDERATION = FederationSpec(
    sites=["s1", "s2"], federation_id="fed-off", round_settings={"classes": ["a"], "feature_dim": 2}
)


def _marker(site: str, what: str) -> bytes:
    return f"<<{what} of {site}: patient statistics>>".encode() * 40


def _state_bytes(state: Path) -> bytes:
    """Every byte of every file in the state folder (database, WAL, payloads, anchor)."""
    return b"".join(p.read_bytes() for p in sorted(state.rglob("*")) if p.is_file())


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """Two sites' uploads, messages and reports in two rounds."""
    opened = Store(tmp_path / "state", federation_id="fed-off")
    for round_id in ("r1", "r2"):
        for site in ("s1", "s2"):
            data = _marker(site, f"payload {round_id}")
            opened.put_upload(
                round_id, site, "stats", data=data, sha256=hashlib.sha256(data).digest()
            )
            opened.put_message(
                round_id, stage=2, site_id=site, kind="shares", data=_marker(site, "message")
            )
            opened.put_report(round_id, site, _marker(site, "report"), audit={"site": site})
    yield opened
    opened.close()


def test_offboarding_deletes_the_sites_data_with_evidence_and_leaves_no_byte(
    store: Store,
) -> None:
    state = store.state_dir
    assert _marker("s2", "message") in _state_bytes(state)  # the test can see the bytes
    detail = store.purge_site("s2", by="operator", reason="left the consortium")

    gone = _state_bytes(state)
    for what in ("payload r1", "payload r2", "message", "report"):
        assert _marker("s2", what) not in gone, what
        assert _marker("s1", what) in gone, what  # the other site's data is untouched
    assert not list(state.glob("payloads/*/s2/*")) and list(state.glob("payloads/*/s1/*"))
    assert {m.site_id for m in store.messages("r1")} == {"s1"}
    assert set(store.reports("r2")) == {"s1"}

    # The evidence: exactly what was deleted, by digest, in the hash-chained audit log.
    (record,) = [d for _, e, d, _, _ in store.audit_entries() if e == "site-offboarded"]
    assert record == detail and record["site_id"] == "s2" and record["by"] == "operator"
    sha = lambda data: hashlib.sha256(data).hexdigest()  # noqa: E731
    assert sorted(p["sha256"] for p in record["payloads"]) == sorted(  # type: ignore[attr-defined]
        sha(_marker("s2", f"payload {r}")) for r in ("r1", "r2")
    )
    assert [m["sha256"] for m in record["messages"]] == [sha(_marker("s2", "message"))] * 2  # type: ignore[attr-defined]
    assert [r["sha256"] for r in record["reports"]] == [sha(_marker("s2", "report"))] * 2  # type: ignore[attr-defined]
    assert store.verify_audit_chain()
    store.close()
    Store(state, federation_id="fed-off").close()  # the anchor and payload checks still pass


def test_a_retention_purge_leaves_no_message_bytes_either(store: Store) -> None:
    assert store.purge_payloads(["r1"]) == 2
    left = _state_bytes(store.state_dir)
    assert _marker("s1", "payload r1") not in left and _marker("s1", "payload r2") in left
    assert store.messages("r1") == [] and store.messages("r2")
    # r2's messages are still stored, and the WAL holds no image of r1's deleted rows.
    wal = store.state_dir / "server.sqlite3-wal"
    assert not wal.exists() or wal.stat().st_size == 0


def test_a_scrub_another_reader_holds_up_is_done_again_once_the_reader_is_gone(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A process that reads the state (as `afl-server status` does) while a purge scrubs keeps
    the WAL from being emptied: the scrub says so, stays pending, and the next retention tick
    does it again once the read has ended: no deleted byte and an empty WAL."""
    store.scrub_wait_s = 0.05  # the test's reader never lets go in time
    caplog.set_level(logging.INFO, logger="afl.server.store")
    reader = sqlite3.connect(store.path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM messages").fetchone()[0] > 0  # a snapshot
        store.purge_site("s2", by="operator", reason="left")
        assert store.scrub_pending
        assert "kept the database's write-ahead log from being emptied" in caplog.text
    finally:
        reader.execute("COMMIT")
        reader.close()
    wal = store.state_dir / "server.sqlite3-wal"
    assert wal.stat().st_size > 0  # the pages VACUUM wrote, not yet checkpointed
    assert store.retry_erasures() == 0 and not store.scrub_pending
    assert "the pending scrub is finished" in caplog.text
    gone = _state_bytes(store.state_dir)
    for what in ("message", "report"):
        assert _marker("s2", what) not in gone and _marker("s1", what) in gone, what
    assert not wal.exists() or wal.stat().st_size == 0
    assert store.scrub() and not store.scrub_pending  # nothing holds it now


def test_the_offboard_command_refuses_a_running_server_and_an_unknown_site(
    federation: ProvisionedFederation,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = load_config(federation.server_dir / "server.toml")
    config = replace(config, listen=f"127.0.0.1:{free_port()}", state_dir=tmp_path / "state")
    Store(config.state_dir, federation_id=config.federation_id).close()
    with pytest.raises(ConfigError, match="neither in server"):
        _offboard(config, site="s9", by="operator", reason="test")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        running = replace(config, listen=f"127.0.0.1:{busy.getsockname()[1]}")
        with pytest.raises(ConfigError, match="stop it first"):
            _offboard(running, site="s2", by="operator", reason="test")
    assert _offboard(config, site="s2", by="operator", reason="test") == 0
    out = capsys.readouterr().out
    assert "site s2 offboarded by operator" in out and "enrolment and audit records stay" in out
    # another process reading the state meanwhile: said, non-zero; run again once it is gone
    monkeypatch.setattr(store_module, "SCRUB_WAIT_S", 0.05)
    reader = sqlite3.connect(config.state_dir / "server.sqlite3", isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM audit_log").fetchone()
        assert _offboard(config, site="s2", by="operator", reason="again") == 1
    finally:
        reader.execute("COMMIT")
        reader.close()
    err = capsys.readouterr().err
    assert "may still hold the deleted rows' bytes" in err and "offboard --site s2` again" in err
    assert _offboard(config, site="s2", by="operator", reason="again") == 0
