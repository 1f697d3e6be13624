"""The coordinator's federation-log calls that need no turn of their own under its lock.

Group commit (afl.server.groupcommit): the steps queued while the lock was held commit in one
transaction and each caller returns only once it committed; a refused step undoes only its own
writes and fails only its caller; any other error, or a failed commit, fails every caller of the
batch and keeps nothing; a batch never runs inside a transaction it cannot commit. Through the
coordinator, the sites' cosignatures commit that way, and GetLogEntries answers while another
call holds the lock."""

from __future__ import annotations

import functools
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from afl.crypto.identity import signatures
from afl.crypto.transparency.checkpoint import cosign
from afl.proto import wire
from afl.server.errors import NotPermittedError, ServerError
from afl.server.groupcommit import GroupCommit
from afl.server.store import Store
from tests.helpers.federation import FederationSpec
from tests.helpers.inprocess import enrolled_coordinator, site_key

SITES = ["p1", "p2", "p3"]
FEDERATION = FederationSpec(
    sites=SITES, round_settings={"classes": ["a"], "feature_dim": 2, "min_participants": 3}
)

WAIT_S = 60.0  # generous: only a hang reaches it
ROOT = bytes(32)


class _Recorder:
    """A store whose transactions record what happens (outer ones: begin, commit)."""

    def __init__(self, *, failing_commit: bool = False) -> None:
        self.events: list[str] = []
        self.depth = 0
        self.failing_commit = failing_commit

    @property
    def in_transaction(self) -> bool:
        return self.depth > 0

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self.depth += 1
        if self.depth == 1:
            self.events.append("begin")
        try:
            yield
        finally:
            self.depth -= 1
        if self.depth == 0:
            if self.failing_commit:
                raise OSError("disk full")
            self.events.append("commit")


def _queued(group: GroupCommit, n: int) -> None:
    """Wait until ``n`` steps are queued (their callers block on the lock)."""
    pause = threading.Event()
    for _ in range(int(WAIT_S / 0.005)):
        if len(group._queue) >= n:
            return
        pause.wait(0.005)
    raise AssertionError(f"{n} steps never queued")


def _callers(
    group: GroupCommit,
    lock: Any,
    calls: Mapping[str, Callable[[], object]],
) -> dict[str, object]:
    """Each call (which runs one step through ``group``) made by its own thread while ``lock`` is
    held, then the lock released: what each caller got (its result or what it raised)."""
    got: dict[str, object] = {}

    def call(name: str) -> None:
        try:
            got[name] = calls[name]()
        except Exception as exc:
            got[name] = exc

    threads = [threading.Thread(target=call, args=(name,)) for name in calls]
    with lock:
        for t in threads:
            t.start()
        _queued(group, len(calls))
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive()
    return got


def _steps(group: GroupCommit, steps: Mapping[str, Callable[[], object]]) -> dict[str, Any]:
    return {name: functools.partial(group.run, step) for name, step in steps.items()}


def _keep(store: Store, witness: str) -> str:
    store.put_log_cosignature(size=1, root=ROOT, witness=witness, signature=b"s" * 64)
    return witness


def _kept(store: Store) -> list[str]:
    return [w for w, _, _ in store.log_cosignatures(1)]


def test_steps_queued_behind_the_lock_commit_together_and_return_after_the_commit() -> None:
    store, lock = _Recorder(), threading.RLock()
    group = GroupCommit(store, lock, isolated=(ServerError,))

    def step(name: str) -> str:
        store.events.append(f"step {name}")
        return name

    def caller(name: str) -> str:
        result = group.run(functools.partial(step, name))
        store.events.append(f"returned {name}")  # after the commit, whoever committed it
        return result

    got = _callers(group, lock, {n: functools.partial(caller, n) for n in ("a", "b", "c")})
    assert got == {"a": "a", "b": "b", "c": "c"}
    assert (group.batches, group.steps) == (1, 3)  # one caller committed every step
    commit = store.events.index("commit")
    assert store.events[0] == "begin" and store.events.count("commit") == 1
    assert sorted(store.events[1:commit]) == ["step a", "step b", "step c"]
    assert sorted(store.events[commit + 1 :]) == ["returned a", "returned b", "returned c"]
    assert group.run(lambda: "alone") == "alone" and group.batches == 2  # nobody queued: its own


def test_a_refused_step_undoes_only_its_own_writes_and_fails_only_its_caller(
    tmp_path: Path,
) -> None:
    store, lock = Store(tmp_path, federation_id="fed"), threading.RLock()
    group = GroupCommit(store, lock, isolated=(ServerError,))

    def keep_then_refuse() -> str:
        _keep(store, "site-2")  # written, then undone with the step
        raise NotPermittedError("the cosignature does not verify")

    steps = {"1": lambda: _keep(store, "site-1"), "2": keep_then_refuse}
    got = _callers(group, lock, _steps(group, {**steps, "3": lambda: _keep(store, "site-3")}))
    assert got["1"] == "site-1" and got["3"] == "site-3"
    assert isinstance(got["2"], NotPermittedError) and "does not verify" in str(got["2"])
    assert group.batches == 1 and _kept(store) == ["site-1", "site-3"]
    store.close()
    reopened = Store(tmp_path, federation_id="fed")  # committed: durable, the anchor agrees
    assert _kept(reopened) == ["site-1", "site-3"]
    reopened.close()


def test_any_other_error_of_a_step_fails_the_whole_batch_and_keeps_nothing(
    tmp_path: Path,
) -> None:
    """A database error is not a refusal: the batch's transaction is not to be trusted after
    it, so nothing of it commits and every caller hears of it (each its own copy)."""
    store, lock = Store(tmp_path, federation_id="fed"), threading.RLock()
    group = GroupCommit(store, lock, isolated=(ServerError,))

    def fail() -> str:
        raise sqlite3.OperationalError("disk I/O error")

    steps = {"1": lambda: _keep(store, "site-1"), "2": fail, "3": lambda: _keep(store, "site-3")}
    got = _callers(group, lock, _steps(group, steps))
    assert all(isinstance(e, sqlite3.OperationalError) for e in got.values()), got
    assert len({id(e) for e in got.values()}) == 3  # not one object raised in three threads
    assert _kept(store) == [] and not store.in_transaction
    assert group.run(lambda: _keep(store, "site-1")) == "site-1"  # the next batch commits
    assert _kept(store) == ["site-1"]
    store.close()


def test_a_failing_commit_reaches_every_caller_of_the_batch() -> None:
    store, lock = _Recorder(failing_commit=True), threading.RLock()
    group = GroupCommit(store, lock, isolated=(ServerError,))
    got = _callers(group, lock, _steps(group, {"a": lambda: "a", "b": lambda: "b"}))
    assert all(isinstance(v, OSError) and "disk full" in str(v) for v in got.values())
    assert "commit" not in store.events
    with pytest.raises(OSError, match="disk full"):  # and the next caller's own commit, too
        group.run(lambda: "c")


def test_a_batch_is_never_run_inside_an_open_transaction(tmp_path: Path) -> None:
    """Inside one, the batch's transaction would be a savepoint: its callers would be answered
    before anything is committed."""
    store, lock = Store(tmp_path, federation_id="fed"), threading.RLock()
    group = GroupCommit(store, lock, isolated=(ServerError,))
    with lock, store.transaction(), pytest.raises(RuntimeError, match="outside any open"):
        group.run(lambda: _keep(store, "site-1"))
    assert _kept(store) == []
    store.close()


def test_sites_cosigning_together_are_committed_in_one_batch_and_a_forgery_only_fails_itself(
    federation: object,
) -> None:
    """Through the coordinator: three sites cosign the same checkpoint while the lock is busy
    (one with a key that is not its own); the two honest cosignatures are kept in one commit,
    each caller is answered with the checkpoint as its own step left it, and the forgery is
    refused to its caller alone."""
    coordinator = enrolled_coordinator(federation, SITES)
    for site in SITES:
        coordinator.require_enrolled(site)  # read once: the calls below queue without the lock
    checkpoint = wire.checkpoint_from_proto(coordinator.log_checkpoint("p1").checkpoint).checkpoint
    keys = {
        "p1": site_key(federation, "p1"),
        "p2": signatures.generate_identity_key(),  # not p2's enrolled key
        "p3": site_key(federation, "p3"),
    }
    requests = {
        s: wire.cosignature_to_proto(cosign(k, witness=s, checkpoint=checkpoint))
        for s, k in keys.items()
    }
    before = coordinator.log_writes.batches
    got = _callers(
        coordinator.log_writes,
        coordinator.lock,
        {s: functools.partial(coordinator.log_cosign, s, requests[s]) for s in SITES},
    )
    assert coordinator.log_writes.batches == before + 1
    assert isinstance(got["p2"], NotPermittedError)
    for site in ("p1", "p3"):  # as a serial commit answers: its own and those before it
        witnesses = {c.witness for c in got[site].cosignatures}  # type: ignore[attr-defined]
        assert site in witnesses and witnesses <= {"p1", "p3"}
    kept = coordinator.log.cosigned(checkpoint.size).cosignatures
    assert [c.witness for c in kept] == ["p1", "p3"]
    coordinator.store.close()


def test_the_log_s_entries_are_served_while_another_call_holds_the_lock(
    federation: object,
) -> None:
    coordinator = enrolled_coordinator(federation, SITES)
    coordinator.require_enrolled("p1")
    answered: list[int] = []

    def read() -> None:
        answered.extend(e.index for e in coordinator.log_entries("p1", 0, 100).entries)

    reader = threading.Thread(target=read)
    with coordinator.lock:  # as a long transition does
        reader.start()
        reader.join(WAIT_S)
        assert not reader.is_alive()  # it did not wait for the lock
    assert answered == list(range(coordinator.store.log_size())) and answered
    coordinator.store.close()
