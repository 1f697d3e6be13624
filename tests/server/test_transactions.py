"""One transaction per transition (docs/architecture.md §2 and §8): a round machine transition
commits its state and its audit record together. A coordinator killed while appending a
transition's audit record (where the write had already committed before) restarts with a valid
audit chain (`afl verify-log`) that agrees with the state, and resumes the run to its model."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from afl.crypto.identity import signatures
from afl.ops.verify_log import read_sqlite, verify_chain
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.wire import AssembledPayload, stage_name
from afl.server.config import load_config
from afl.server.coordinator import Coordinator
from afl.server.store import DB_NAME, Store
from tests.helpers.federation import FederationSpec
from tests.helpers.inprocess import accept_plan, enrol

SITES = ["p1", "p2", "p3"]
FEDERATION = FederationSpec(
    sites=SITES,
    round_settings={"classes": ["a"], "feature_dim": 2, "min_participants": 3},
)
REPO = Path(__file__).resolve().parents[2]


class _Federation:
    """The parts of a provisioned federation the driver reads (rebuilt in the subprocess)."""

    def __init__(self, server_dir: str, site_dirs: dict[str, str]) -> None:
        self.server_dir = Path(server_dir)
        self.site_dirs = {s: Path(p) for s, p in site_dirs.items()}


def _coordinator(federation: Any, state: Path) -> Coordinator:
    config = load_config(federation.server_dir / "server.toml")
    config = replace(config, state_dir=state)
    key = signatures.load_private_key_pem((federation.server_dir / "identity.key").read_bytes())
    return Coordinator(config, Store(state, federation_id=config.federation_id), key)


def _drive(federation: Any, state: Path) -> Coordinator:
    """Take run-1 as far as it goes from whatever the state holds: enrol, accept, upload."""
    coordinator = _coordinator(federation, state)
    for site in SITES:
        enrol(coordinator, federation, site)
    view = coordinator.find("")
    decided = coordinator.store.decisions(view.round_id)
    for site in SITES:
        if view.stage == pb.ROUND_STAGE_PLAN_REVIEW and site not in decided:
            accept_plan(coordinator, federation, site, view)
    view = coordinator.find("")
    for site in SITES:
        for release in view.releases:
            if view.stage != pb.ROUND_STAGE_UPLOAD:
                break
            if (site, release.name) in coordinator.store.uploads(view.round_id):
                continue
            data = bytes(8 * release.length)
            payload = AssembledPayload(
                view.round_id,
                release.name,
                pb.PAYLOAD_KIND_STATISTIC,
                data,
                hashlib.sha256(data).digest(),
            )
            coordinator.upload(site, payload)
            view = coordinator.find("")
    return coordinator


def die_at(arguments: str) -> None:
    """The subprocess: drive run-1, dying (like SIGKILL: no cleanup, no checkpoint) at the
    ``n``-th append of audit ``event``, where the code before one transaction per transition
    had already committed the transition's write."""
    spec = json.loads(arguments)
    event, nth = spec["event"], int(spec["nth"])
    original = Store._append_audit
    seen = [0]

    def append(db: Any, name: str, detail: dict[str, object]) -> None:
        if name == event:
            seen[0] += 1
            if seen[0] == nth:
                import os

                os._exit(9)
        original(db, name, detail)

    setattr(Store, "_append_audit", staticmethod(append))  # noqa: B010 (a patched class)
    _drive(_Federation(spec["server_dir"], spec["site_dirs"]), Path(spec["state"]))
    raise SystemExit(f"the driver finished without appending {event!r} {nth} times")


def _assert_agree(store: Store) -> None:
    """Every run, round, plan, stage and model in the state has its audit record, and every
    transition's record has its state."""
    records = [(event, detail) for _, event, detail, _, _ in store.audit_entries()]

    def ids(event: str, key: str) -> list[object]:
        return [d[key] for e, d in records if e == event]

    runs = store.runs()
    assert [r.run_id for r in runs] == ids("run-submitted", "run_id")
    assert [r.run_id for r in runs if r.state != "queued"] == ids("run-started", "run_id")
    finished = {d["run_id"]: d["state"] for e, d in records if e == "run-finished"}
    assert finished == {r.run_id: r.state for r in runs if r.state in ("published", "aborted")}
    rounds = store.rounds()
    assert [r.round_id for r in rounds] == ids("round-created", "round_id")
    assert [r.round_id for r in rounds if r.plan] == ids("plan-published", "round_id")
    stages = {d["round_id"]: d["stage"] for e, d in records if e == "stage"}
    for row in rounds:
        if row.stage in (pb.ROUND_STAGE_WAITING_FOR_PARTICIPANTS, pb.ROUND_STAGE_PLAN_REVIEW):
            assert row.round_id not in stages
        else:
            assert stages[row.round_id] == stage_name(row.stage)
        assert (store.model(row.round_id) is not None) == (row.stage == pb.ROUND_STAGE_PUBLISHED)
        if row.stage == pb.ROUND_STAGE_PUBLISHED:
            published = next(
                d for e, d in reversed(records) if e == "stage" and d["round_id"] == row.round_id
            )
            model = store.model(row.round_id)
            assert model is not None
            assert published["model_sha256"] == hashlib.sha256(model[1]).hexdigest()


def test_a_nested_transaction_commits_once_or_not_at_all(tmp_path: Path) -> None:
    store = Store(tmp_path / "state", federation_id="fed")
    commits = int(str(store.anchor()["commits"]))
    with store.transaction():
        store.create_run(run_id="run-1", name="a", settings={}, submitted_by="t")
        store.audit("run-submitted", {"run_id": "run-1"})
    anchor = store.anchor()
    assert anchor["commits"] == commits + 1 and anchor["audit_count"] == 1
    with pytest.raises(RuntimeError), store.transaction():
        store.update_run("run-1", state="active")
        store.audit("run-started", {"run_id": "run-1"})
        raise RuntimeError("dies before the commit")
    assert store.runs()[0].state == "queued" and len(store.audit_entries()) == 1
    assert store.anchor() == anchor
    with store.transaction():  # an inner block that fails undoes only itself
        store.audit("kept", {})
        with pytest.raises(TypeError), store.transaction():
            store.update_run("run-1", state="active")
            store.audit("never", {"x": {1j}})  # a detail JSON cannot hold
    assert store.runs()[0].state == "queued"
    assert [e[1] for e in store.audit_entries()] == ["run-submitted", "kept"]
    assert store.anchor()["commits"] == commits + 2
    store.close()


@pytest.mark.parametrize(
    ("event", "nth"),
    [
        ("run-submitted", 1),  # the run queue: submit
        ("run-started", 1),  # activation
        ("round-created", 1),  # a new round
        ("plan-published", 1),  # the end of opening a plan
        ("stage", 1),  # PLAN_REVIEW -> UPLOAD
        ("stage", 3),  # SOLVING -> PUBLISHED, with the model
        ("run-finished", 1),  # the run ends
    ],
)
def test_a_coordinator_killed_inside_a_transition_restarts_consistent(
    federation: Any, tmp_path: Path, event: str, nth: int
) -> None:
    state = tmp_path / "state"
    spec = {
        "event": event,
        "nth": nth,
        "state": str(state),
        "server_dir": str(federation.server_dir),
        "site_dirs": {s: str(p) for s, p in federation.site_dirs.items()},
    }
    code = "import sys; from tests.server.test_transactions import die_at; die_at(sys.argv[1])"
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert verify_chain(read_sqlite(state / DB_NAME)).ok  # what `afl verify-log` checks
    store = Store(state, federation_id=federation.federation_id)  # the anchor agrees
    _assert_agree(store)
    store.close()
    coordinator = _drive(federation, state)  # the restart resumes the run to its model
    assert coordinator.store.runs()[0].state == "published"
    _assert_agree(coordinator.store)
    assert verify_chain(read_sqlite(state / DB_NAME)).ok
