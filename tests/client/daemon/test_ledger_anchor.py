"""A site's DP ledger anchored in the federation log (docs/protocol.md §11a, M-195..M-197),
against the coordinator's real log (:class:`afl.server.transparency.FederationLog` on a real
store) behind the in-process RPC stand-in: each entry is published as the site's signed
`dp-release` statement before its upload, a ledger that is missing, shorter or different is
refused at start-up with the recovery command, and the rebuild restores it byte for byte."""

from __future__ import annotations

import math
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from afl.client.daemon.anchor import (
    LedgerAnchor,
    LedgerNotAnchored,
    rebuild_ledger,
    release_statement,
)
from afl.client.daemon.rpc import CoordinatorClient
from afl.client.daemon.transparency import LogWitness
from afl.client.daemon.transport import DaemonError
from afl.client.modes.base import RoundSession, upload_record
from afl.client.policy.ledger import DpLedger, LedgerEntry, LedgerError
from afl.core.dp.accounting import compose_mu
from afl.crypto.identity.signatures import generate_identity_key, public_key_to_raw
from afl.crypto.transparency.statements import decode_statement
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.errors import NotPermittedError
from afl.server.store import backup_state
from tests.helpers.fedlog import LogService

FED = "fed-anchor"
COORDINATOR = generate_identity_key()
SITES = {f"site-{i}": generate_identity_key() for i in (1, 2, 3)}
ROSTER = {s: public_key_to_raw(k) for s, k in SITES.items()}
PLAN = b"a signed release plan"
REBUILD = "afl-client budget --rebuild-from-log --config client.toml"


def _coordinator(state: Path) -> LogService:
    service = LogService(state, key=COORDINATOR, federation_id=FED)
    for site, key in ROSTER.items():
        service.enrol(site, key)
    return service


def _witness(state: Path) -> LogWitness:
    return LogWitness(
        state,
        site_id="site-1",
        federation_id=FED,
        key=SITES["site-1"],
        coordinator_key=COORDINATOR.public_key(),
        roster=ROSTER,
    )


def _anchor(state: Path) -> LedgerAnchor:
    return LedgerAnchor(
        DpLedger(state / "dp-ledger"), _witness(state), key=SITES["site-1"], config="client.toml"
    )


def _spend(anchor: LedgerAnchor, coordinator: LogService, round_id: str, mu: float) -> None:
    """What the daemon does before an upload: record the entry, then publish it."""
    anchor.publish(coordinator.call, _entry(anchor, coordinator, round_id, mu))


def _entry(anchor: LedgerAnchor, coordinator: LogService, round_id: str, mu: float) -> LedgerEntry:
    """The ledger entry of a round whose plan is in the coordinator's store (the log takes
    dp-releases of signed plans only), recorded and not yet published."""
    plan_sha256 = coordinator.publish_plan(round_id, PLAN).hex()
    return anchor.ledger.record(
        federation_id=FED, round_id=round_id, round_number=1, run_id=round_id,
        plan_sha256=plan_sha256, aggregation="AGGREGATION_MODE_MASK",
        unit="patient", images_per_patient=2, delta=1e-6, mu=mu, epsilon=4.0 * mu,
        releases=({"name": "gram", "sensitivity": 1.0, "sigma": 1.0 / mu},),
    )  # fmt: skip


def _two_releases(tmp_path: Path) -> tuple[LogService, LedgerAnchor]:
    coordinator = _coordinator(tmp_path / "server")
    anchor = _anchor(tmp_path / "site")
    anchor.reconcile(coordinator.call)  # a fresh site, an empty log of its releases
    _spend(anchor, coordinator, "round-a", 0.5)
    _spend(anchor, coordinator, "round-b", 0.25)
    return coordinator, anchor


def _refusal(tmp_path: Path, coordinator: LogService) -> str:
    with pytest.raises(LedgerNotAnchored) as caught:
        _anchor(tmp_path / "site").reconcile(coordinator.call)  # a restart
    line = str(caught.value)
    assert "\n" not in line and f"run `{REBUILD}`" in line
    return line


def test_each_entry_is_the_sites_signed_statement_in_the_log(tmp_path: Path) -> None:
    coordinator, anchor = _two_releases(tmp_path)
    kinds = [k for _, k, _, _ in coordinator.log.entries(0, coordinator.store.log_size())]
    assert kinds.count("dp-release") == 2
    entries = [e.to_json() for e in anchor.ledger.entries()]
    logged = [
        decode_statement(s, federation=FED)[1]["entry"]
        for _, k, s, _ in coordinator.log.entries(0, 100)
        if k == "dp-release"
    ]
    assert logged == entries
    _anchor(tmp_path / "site").reconcile(coordinator.call)  # a restart on the same ledger: fine


def test_a_missing_ledger_is_refused(tmp_path: Path) -> None:
    coordinator, _ = _two_releases(tmp_path)
    shutil.rmtree(tmp_path / "site" / "dp-ledger")
    assert "the DP ledger is missing" in _refusal(tmp_path, coordinator)


def test_a_shorter_ledger_is_refused(tmp_path: Path) -> None:
    coordinator, anchor = _two_releases(tmp_path)
    max(anchor.ledger.root.glob("*.json")).unlink()  # an old backup: the last entry gone
    assert "shorter than the federation log: 1 entries, the log holds 2" in _refusal(
        tmp_path, coordinator
    )


def test_a_different_ledger_is_refused(tmp_path: Path) -> None:
    coordinator, anchor = _two_releases(tmp_path)
    other = tmp_path / "other"
    forged = _anchor(other)  # a ledger with the same rounds, a smaller first spend
    forged.ledger.record(**{
        k: v for k, v in anchor.ledger.entries()[0].to_json().items()
        if k not in ("seq", "recorded_unix_ms", "prev_sha256")
    } | {"mu": 0.01, "releases": ()})  # fmt: skip
    shutil.rmtree(anchor.ledger.root)
    shutil.copytree(forged.ledger.root, anchor.ledger.root)
    assert "differs from the federation log at entry 1" in _refusal(tmp_path, coordinator)


def test_a_running_daemon_refuses_plans_once_its_ledger_is_cut(tmp_path: Path) -> None:
    _, anchor = _two_releases(tmp_path)
    assert anchor.problem() == ""
    shutil.rmtree(anchor.ledger.root)
    assert "no longer holds the 2 release(s)" in anchor.problem()


def test_an_entry_not_yet_published_is_published_at_start_up(tmp_path: Path) -> None:
    coordinator, anchor = _two_releases(tmp_path)
    anchor.ledger.record(
        **{
            k: v
            for k, v in anchor.ledger.entries()[1].to_json().items()
            if k not in ("seq", "recorded_unix_ms", "prev_sha256")
        }
        | {"round_id": "round-c"}
    )  # fmt: skip  (the site stopped before publishing it)
    coordinator.publish_plan("round-c", PLAN)
    size = coordinator.store.log_size()
    _anchor(tmp_path / "site").reconcile(coordinator.call)
    assert coordinator.store.log_size() == size + 1
    _anchor(tmp_path / "site").reconcile(coordinator.call)  # published once
    assert coordinator.store.log_size() == size + 1


def test_the_coordinator_refuses_a_statement_the_site_did_not_sign(tmp_path: Path) -> None:
    coordinator, anchor = _two_releases(tmp_path)
    entry = anchor.ledger.entries()[0]
    forged = release_statement(SITES["site-2"], federation=FED, site="site-1", entry=entry)
    with pytest.raises(NotPermittedError, match="signature does not verify"):
        coordinator.log.record_dp_release("site-1", forged)
    mine = release_statement(SITES["site-1"], federation=FED, site="site-1", entry=entry)
    with pytest.raises(NotPermittedError, match="names site 'site-1', the caller is 'site-2'"):
        coordinator.log.record_dp_release("site-2", mine)


def test_the_log_takes_one_statement_per_round_in_ledger_order(tmp_path: Path) -> None:
    """A dp-release is appended only with the site's next ledger number and only once per
    round; a round this coordinator has no plan of is accepted (a spend carried over from a
    coordinator that lost or restored its state, M-196)."""
    coordinator, anchor = _two_releases(tmp_path)
    size = coordinator.store.log_size()
    key, first = SITES["site-1"], anchor.ledger.entries()[0].to_json()

    def statement(**change: object) -> bytes:
        entry = LedgerEntry.from_json(first | change)
        return release_statement(key, federation=FED, site="site-1", entry=entry)

    cases = {
        "already holds a dp-release of site-1 for round 'round-a'": statement(seq=3, mu=0.01),
        "the next is 3": statement(round_id="round-c", seq=5),
    }
    for why, forged in cases.items():
        with pytest.raises(NotPermittedError, match=why):
            coordinator.log.record_dp_release("site-1", forged)
    assert coordinator.store.log_size() == size
    # The same statement again is not a second one: its index.
    again = release_statement(key, federation=FED, site="site-1", entry=anchor.ledger.entries()[0])
    assert coordinator.log.record_dp_release("site-1", again) < size
    carried = statement(round_id="round-of-an-earlier-log", seq=3)
    assert coordinator.log.record_dp_release("site-1", carried) == size


def test_a_forged_statement_in_the_log_is_refused_by_the_site(tmp_path: Path) -> None:
    coordinator, anchor = _two_releases(tmp_path)
    doc = anchor.ledger.entries()[0].to_json()
    coordinator.store.append_log(  # the coordinator writes the log directly
        "dp-release", {"site": "site-1", "entry": doc, "signature": "00" * 64}
    )
    with pytest.raises(DaemonError, match="that it did not sign"):
        _anchor(tmp_path / "site").reconcile(coordinator.call)


def test_rebuild_restores_the_ledger_and_the_spend_composes(tmp_path: Path) -> None:
    coordinator, anchor = _two_releases(tmp_path)
    before = {p.name: p.read_bytes() for p in anchor.ledger.root.glob("*.json")}
    head = anchor.ledger.head()
    shutil.rmtree(anchor.ledger.root)
    _refusal(tmp_path, coordinator)
    for site in ("site-2", "site-3"):  # the quorum: a majority of the roster witnesses
        other = LogWitness(
            tmp_path / site, site_id=site, federation_id=FED, key=SITES[site],
            coordinator_key=COORDINATOR.public_key(), roster=ROSTER,
        )  # fmt: skip
        other.witness(coordinator.call)
    rebuilt = _anchor(tmp_path / "site")
    entries = rebuild_ledger(coordinator.call, rebuilt.witness, rebuilt.ledger, quorum_wait_s=5)
    assert {p.name: p.read_bytes() for p in rebuilt.ledger.root.glob("*.json")} == before
    assert rebuilt.ledger.head() == head and len(entries) == 2
    restarted = _anchor(tmp_path / "site")
    restarted.reconcile(coordinator.call)  # accepted now
    _spend(restarted, coordinator, "round-c", 0.125)  # the next release composes with both
    spent = restarted.ledger.spent(unit="patient")
    assert spent.entries == 3
    assert spent.mu == pytest.approx(math.sqrt(0.5**2 + 0.25**2 + 0.125**2))
    assert spent.mu == pytest.approx(compose_mu([0.5, 0.25, 0.125]))


def test_rebuild_refuses_without_a_quorum_and_over_a_different_ledger(tmp_path: Path) -> None:
    coordinator, anchor = _two_releases(tmp_path)
    with pytest.raises(DaemonError, match="no federation-log checkpoint cosigned by a quorum"):
        rebuild_ledger(coordinator.call, anchor.witness, anchor.ledger, quorum_wait_s=0.2)
    max(anchor.ledger.root.glob("*.json")).unlink()
    entry = anchor.ledger.entries()[0].to_json()
    shutil.rmtree(anchor.ledger.root)
    DpLedger(anchor.ledger.root).record(**{
        k: v for k, v in entry.items() if k not in ("seq", "recorded_unix_ms", "prev_sha256")
    } | {"mu": 0.01})  # fmt: skip
    for site in ("site-2", "site-3"):
        LogWitness(
            tmp_path / site, site_id=site, federation_id=FED, key=SITES[site],
            coordinator_key=COORDINATOR.public_key(), roster=ROSTER,
        ).witness(coordinator.call)  # fmt: skip
    with pytest.raises(LedgerError, match="move it aside"):
        rebuild_ledger(coordinator.call, anchor.witness, anchor.ledger, quorum_wait_s=5)


def test_a_coordinator_that_drops_the_statement_gets_no_upload(tmp_path: Path) -> None:
    """RecordDpRelease answered but the statement never appended: the site finds no inclusion
    proof in the newest checkpoint it witnessed and stops before its upload (M-195)."""
    coordinator = _coordinator(tmp_path / "server")
    anchor = _anchor(tmp_path / "site")
    anchor.reconcile(coordinator.call)
    honest = coordinator.call

    def dropping(what: str, request: object) -> object:
        if what == "RecordDpRelease":
            return pb.LogProof(index=0)  # an answer, and nothing logged
        return honest(what, request)

    size = coordinator.store.log_size()
    with pytest.raises(DaemonError, match="does not hold this site's dp-release of round round-a"):
        _spend(
            anchor,
            cast(LogService, SimpleNamespace(call=dropping, publish_plan=coordinator.publish_plan)),
            "round-a",
            0.5,
        )
    assert coordinator.store.log_size() == size + 1  # the round's plan only
    assert anchor.logged == []  # not counted as published: the next start publishes it again


def _session(on_upload: Callable[[str], None], *, wait: Callable[[], None]) -> RoundSession:
    """A round session whose uploads call ``on_upload`` with the slot (the site's other
    messages go through ``rpc.call``, which answers at once); ``wait``: its
    ``before_statistics``."""

    def upload(data: bytes, *, round_id: str, release_name: str) -> pb.UploadReceipt:
        on_upload(release_name)
        return pb.UploadReceipt(duplicate=False)

    rpc = SimpleNamespace(upload=upload, call=lambda what, request: None)
    return RoundSession(
        rpc=cast(CoordinatorClient, rpc),
        round_id="round-a",
        site_id="site-1",
        plan=cpb.ReleasePlan(),
        identity_key=SITES["site-1"],
        before_statistics=wait,
    )


def test_statistics_leave_only_once_the_statement_is_logged_and_other_messages_need_not_wait(
    tmp_path: Path,
) -> None:
    """The daemon logs the statement in the background while the round's first messages go
    (a masked round's key advert and shares carry no statistic); every upload of statistics
    waits for it (M-195)."""
    coordinator = _coordinator(tmp_path / "server")
    anchor = _anchor(tmp_path / "site")
    anchor.reconcile(coordinator.call)
    entry = _entry(anchor, coordinator, "round-a", 0.5)
    release = threading.Event()

    def slow(what: str, request: object) -> object:
        if what == "RecordDpRelease":
            assert release.wait(60)
        return coordinator.call(what, request)

    uploads: list[tuple[str, int]] = []  # (slot, this site's dp-releases in the log then)

    def on_upload(slot: str) -> None:
        uploads.append((slot, len(coordinator.store.log_statements("dp-release"))))

    publication = anchor.start_publishing(slow, entry)
    session = _session(on_upload, wait=publication.wait)
    session.rpc.call("AdvertiseKeys", None)  # a message without statistics: it does not wait
    sent = threading.Thread(target=upload_record, args=(session, "gram", ("gram",), b"x" * 8))
    sent.start()
    sent.join(0.5)
    assert sent.is_alive() and uploads == [] and anchor.logged == []  # held meanwhile
    release.set()
    sent.join(60)
    assert uploads == [("gram", 1)]  # it left with the statement in the log
    assert anchor.logged == [entry.to_json()]


def test_a_dropped_statement_stops_every_upload_of_statistics(tmp_path: Path) -> None:
    """A coordinator that answers RecordDpRelease without logging the statement gets no
    statistics: the background publication's refusal is raised at each upload (M-195)."""
    coordinator = _coordinator(tmp_path / "server")
    anchor = _anchor(tmp_path / "site")
    anchor.reconcile(coordinator.call)

    def dropping(what: str, request: object) -> object:
        if what == "RecordDpRelease":
            return pb.LogProof(index=0)  # an answer, and nothing logged
        return coordinator.call(what, request)

    publication = anchor.start_publishing(dropping, _entry(anchor, coordinator, "round-a", 0.5))
    uploads: list[str] = []
    session = _session(uploads.append, wait=publication.wait)
    for _ in range(2):  # every upload, not only the first
        with pytest.raises(DaemonError, match="does not hold this site's dp-release"):
            upload_record(session, "gram", ("gram",), b"x" * 8)
    assert uploads == [] and anchor.logged == []


def test_after_an_acknowledged_restore_the_statements_the_log_lost_are_published_again(
    tmp_path: Path,
) -> None:
    """The coordinator is restored from a backup taken after round-a's statement and before
    round-b's, and its operator acknowledges the restore. A running site took round-b's
    statement as logged; once it learns of the restore it reconciles again and publishes it to
    the restored log, instead of uploading as if the log held it (M-195, M-142)."""
    coordinator = _coordinator(tmp_path / "server")
    anchor = _anchor(tmp_path / "site")
    anchor.reconcile(coordinator.call)
    _spend(anchor, coordinator, "round-a", 0.5)
    backup_state(tmp_path / "server", tmp_path / "backup")
    _spend(anchor, coordinator, "round-b", 0.25)
    assert len(coordinator.store.log_statements("dp-release")) == 2
    restored = LogService(tmp_path / "backup", key=COORDINATOR, federation_id=FED)
    assert len(restored.store.log_statements("dp-release")) == 1
    anchor.reconcile_after_restore(restored.call)  # no restore acknowledged: nothing to do
    assert len(restored.store.log_statements("dp-release")) == 1
    count = restored.store.acknowledge_restore(by="operator", reason="test", aborted_runs=[])
    anchor.witness.restore_acknowledged(count)  # what the site's status answers tell it
    anchor.reconcile_after_restore(restored.call)
    assert len(restored.store.log_statements("dp-release")) == 2
    assert anchor.logged == [e.to_json() for e in anchor.ledger.entries()]
