"""M-21 and M-89 at the level their MUSTs state (docs/protocol.md §6, §7), through the site
daemon: the unmodified :class:`~afl.client.daemon.loop.ClientDaemon` against the scripted
coordinator of ``test_daemon_round_binding`` (what the daemon's RPC client would return; plans are
signed with the federation server's own key).

* M-21: the daemon keeps the releases of the plans it accepted in ``history.json`` on disk; a
  restarted daemon reads them back and refuses a plan that differences against them, sending a
  refusal signed with its identity key over the plan's digest, and uploads nothing; a release
  below its ``min_cohort`` is refused the same way.
* M-89: the ledger entry of a plan is on disk, fsynced (the entry file and the ledger folder), at
  the moment the first upload byte leaves the site: the upload stub reads the ledger from disk
  when it is called."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from afl.client.daemon.loop import ClientDaemon, RoundFailed
from afl.client.policy.ledger import DpLedger
from afl.crypto.errors import SignatureError
from afl.crypto.identity import signatures
from afl.crypto.identity.signed_blobs import (
    PLAN_DECISION_CONTEXT,
    blob_sha256,
    plan_decision_fields,
)
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.plan.dp import dp_releases
from tests.client.daemon.test_daemon_round_binding import (  # the scripted coordinator
    CLASSES,
    DIFFERENCING,
    FEDERATION,
    GLOBAL,
    SITE,
    SITES,
    Coordinator,
    D,
    _b,
    _gram,
    _report,
    site,
)

__all__ = ["FEDERATION", "site"]  # the module's federation and the daemon fixture it uses

Site = tuple[ClientDaemon, Coordinator, Path]


def _history_on_disk(state: Path) -> dict[str, list[str]]:
    """history.json as the daemon wrote it: round/release name -> members."""
    rows = json.loads((state / "history.json").read_text(encoding="utf-8"))["releases"]
    return {f"{r['round_id']}/{r['name'].split('/', 1)[-1]}": r["members"] for r in rows}


def _check_signed_refusal(decision: pb.PlanDecision, cfg: pb.RoundConfig, kit: Path) -> None:
    """The refusal is the site's: signed with its kit's identity key over the plan's digest."""
    assert not decision.accept and decision.reason
    digest = blob_sha256(cfg.release_plan.plan)
    assert decision.plan_sha256 == digest
    key = signatures.load_private_key_pem((kit / "identity.key").read_bytes()).public_key()
    fields = plan_decision_fields(round_id=cfg.round_id, accept=False, plan_sha256=digest)
    signatures.verify_fields(key, decision.signature, context=PLAN_DECISION_CONTEXT, fields=fields)
    accepting = plan_decision_fields(round_id=cfg.round_id, accept=True, plan_sha256=digest)
    with pytest.raises(SignatureError):  # the signature binds the refusal itself
        signatures.verify_fields(
            key, decision.signature, context=PLAN_DECISION_CONTEXT, fields=accepting
        )


def test_the_daemon_keeps_its_history_on_disk_and_sends_a_signed_refusal(
    site: Site, federation: Any
) -> None:
    daemon, coordinator, state = site
    first = coordinator.announce("r1-aaaa", coordinator.round_config("r1-aaaa", GLOBAL))
    daemon.run_round(first, _report())
    assert [d.accept for d in coordinator.decisions()] == [True]
    assert _history_on_disk(state)["r1-aaaa/gram[all]"] == sorted(SITES)
    uploads = len(coordinator.uploads)

    # A restarted daemon: the history comes from the file, not from memory.
    restarted = ClientDaemon(daemon.config)
    restarted.prepare()
    restarted.rpc = coordinator  # type: ignore[assignment]
    cfg = coordinator.round_config("r2-bbbb", DIFFERENCING)
    second = coordinator.announce("r2-bbbb", cfg)
    with pytest.raises(RoundFailed) as refused:
        restarted.run_round(second, _report())
    assert refused.value.outcome == pb.CLIENT_OUTCOME_REFUSED_PLAN
    assert "expose this site's gram by differencing" in refused.value.reason
    sent = coordinator.decisions()
    assert len(sent) == 2 and sent[-1].round_id == "r2-bbbb"
    _check_signed_refusal(sent[-1], cfg, federation.site_dirs[SITE])
    assert len(coordinator.uploads) == uploads  # nothing of r2 left the site
    assert "r2-bbbb/gram{s1,s2,s3}" not in _history_on_disk(state)  # a refused plan is no history

    # Without the file the same plan passes: the refusal came from the history on disk.
    (state / "history.json").unlink()
    decision, _, _ = restarted._decide(cfg, round_id="r2-bbbb")
    assert decision.accept, decision.reason


def test_the_daemon_refuses_a_release_below_its_min_cohort_with_a_signed_refusal(
    site: Site, federation: Any
) -> None:
    daemon, coordinator, state = site
    small = [_gram("gram[all]", SITES), _b("A"), _b("B", ("s3", SITE))]
    cfg = coordinator.round_config("r1-small", small)
    with pytest.raises(RoundFailed) as refused:
        daemon.run_round(coordinator.announce("r1-small", cfg), _report())
    assert refused.value.outcome == pb.CLIENT_OUTCOME_REFUSED_PLAN
    assert "has 2 member(s) < min cohort 3" in refused.value.reason
    (decision,) = coordinator.decisions()
    _check_signed_refusal(decision, cfg, federation.site_dirs[SITE])
    assert coordinator.uploads == [] and not (state / "history.json").exists()


def test_the_ledger_entry_is_fsynced_on_disk_before_the_first_upload_leaves(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon, coordinator, state = site
    daemon.config = replace(daemon.config, policy=replace(daemon.config.policy, max_epsilon=3.0))
    ledger_dir = state / "dp-ledger"
    events: list[tuple[str, str]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    monkeypatch.setattr(os, "fsync", fsync)
    seen: dict[str, Any] = {}
    upload = coordinator.upload

    def inspecting_upload(data: bytes, *, round_id: str, release_name: str, **kw: Any) -> Any:
        if not seen:  # the first byte that leaves: what a fresh reader finds on disk now
            seen["entry"] = DpLedger(ledger_dir).entry_for(round_id)
            seen["files"] = sorted(p.name for p in ledger_dir.iterdir())
            events.append(("upload", release_name))
        return upload(data, round_id=round_id, release_name=release_name, **kw)

    coordinator.upload = inspecting_upload  # type: ignore[method-assign]
    releases = dp_releases(
        classes=CLASSES, participants=SITES, coverage={}, gram_scope="global", d=D
    )
    cfg = coordinator.round_config("r1-dpdp", releases, dp_epsilon=2.5)
    daemon.run_round(coordinator.announce("r1-dpdp", cfg), _report())

    entry = seen["entry"]
    assert entry is not None, "no ledger entry on disk when the first upload left"
    assert entry.plan_sha256 == blob_sha256(cfg.release_plan.plan).hex()
    assert 0 < entry.epsilon <= 3.0 and entry.releases
    (name,) = seen["files"]
    first_upload = next(i for i, (what, _) in enumerate(events) if what == "upload")
    synced = [path for what, path in events[:first_upload] if what == "fsync"]
    assert str(ledger_dir / f".{name}.tmp") in synced, events  # the entry's bytes, then linked
    assert str(ledger_dir) in synced, events  # and the folder: the new name is durable
    assert len(coordinator.uploads) == len(releases)


def test_the_first_upload_waits_for_the_ledger_statement_logged_in_the_background(
    site: Site,
) -> None:
    """M-195 through the daemon: the round's DP-ledger statement is logged in a background
    thread, and the exchange's first upload leaves only once the log holds it. The stand-in
    coordinator holds RecordDpRelease back until an upload arrives (or 2 s pass): a daemon that
    uploaded without waiting would be seen uploading while the log lacks the statement."""
    daemon, coordinator, _ = site
    uploaded = threading.Event()
    in_log_at_upload: list[int] = []
    call, upload = coordinator.call, coordinator.upload

    def holding_call(what: str, request: Any, **kw: Any) -> Any:
        if what == "RecordDpRelease":
            uploaded.wait(2.0)
        return call(what, request, **kw)

    def inspecting_upload(data: bytes, *, round_id: str, release_name: str, **kw: Any) -> Any:
        if not uploaded.is_set():
            in_log_at_upload.append(len(coordinator.log.store.log_statements("dp-release")))
            uploaded.set()
        return upload(data, round_id=round_id, release_name=release_name, **kw)

    coordinator.call = holding_call  # type: ignore[method-assign]
    coordinator.upload = inspecting_upload  # type: ignore[method-assign]
    cfg = coordinator.round_config("r1-bg", GLOBAL)
    daemon.run_round(coordinator.announce("r1-bg", cfg), _report())
    assert in_log_at_upload == [1]
    assert len(coordinator.uploads) == len(GLOBAL)
