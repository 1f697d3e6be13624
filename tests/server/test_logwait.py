"""What a held GetCheckpoint waits for (afl.server.logwait, docs/protocol.md §11a): the waiter
wakes when its own condition is committed (the cosigners it asked for on its checkpoint, or a
log larger than it saw), or when the store closes, and not for a cosignature that leaves its
condition unmet. A wait that must end by a wake-up is given a timeout far beyond the test's
own join, so a test that passed was woken, whatever the machine's load."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from afl.server.limits import UNARY_WORKERS, StreamLimits, held_calls, worker_threads
from afl.server.logwait import KEPT_CHECKPOINTS, LogChanges
from afl.server.store import Store

LONG_S = 120.0  # a wait's timeout that no passing test reaches
JOIN_S = 30.0  # how long a test waits for a woken waiter


def _waiting(changes: LogChanges, **condition: object) -> tuple[threading.Thread, list[bool]]:
    """A thread waiting on ``changes`` for ``condition`` (timeout :data:`LONG_S`), started, and
    the list its result lands in."""
    result: list[bool] = []
    kwargs: dict[str, object] = {
        "checkpoint": 5, "cosigners": (), "want_cosigners": 0, "grown_past": 0, **condition,
    }  # fmt: skip

    def wait() -> None:
        result.append(changes.wait(timeout_s=LONG_S, **kwargs))  # type: ignore[arg-type]

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, result


def _woken(thread: threading.Thread, result: list[bool]) -> bool:
    thread.join(JOIN_S)
    return not thread.is_alive() and result == [True]


def _stays_waiting(changes: LogChanges, nudge: Callable[[], None], **condition: object) -> None:
    """``nudge`` commits something that must not end a wait for ``condition``: a wait with a
    short timeout, nudged from another thread first, ends unmet."""
    ready = threading.Event()

    def nudger() -> None:
        ready.wait(JOIN_S)
        nudge()

    thread = threading.Thread(target=nudger, daemon=True)
    thread.start()
    kwargs: dict[str, object] = {
        "checkpoint": 5, "cosigners": (), "want_cosigners": 0, "grown_past": 0, **condition,
    }  # fmt: skip
    ready.set()
    assert changes.wait(timeout_s=0.5, **kwargs) is False  # type: ignore[arg-type]
    thread.join(JOIN_S)


def _registered(changes: LogChanges, count: int) -> list[threading.Event]:
    """The wake-up events of the ``count`` waiters ``changes`` holds, once they all wait."""
    deadline = time.monotonic() + JOIN_S
    while len(changes._waiting) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(changes._waiting) == count
    return [waiter.woken for waiter in changes._waiting]


def test_a_quorum_wait_wakes_when_the_cosigner_that_makes_the_count_is_committed() -> None:
    """Only the commit that completes a waiter's count wakes it: a cosignature on another
    checkpoint, a repeated or already counted cosigner, or one short of the count sets no
    waiter's event (no thread wakes to find its condition unmet)."""
    changes = LogChanges(size=5)
    thread, result = _waiting(changes, cosigners=("a",), want_cosigners=3)
    other, other_result = _waiting(changes, checkpoint=6, want_cosigners=1)
    growth, growth_result = _waiting(changes, grown_past=5)
    events = _registered(changes, 3)
    changes.committed(cosigned=[(5, "b")])  # 2 of 3: still waiting
    changes.committed(cosigned=[(5, "a"), (5, "b")])  # counted already
    changes.committed(cosigned=[(4, "c")])  # a checkpoint nobody waits on
    changes.committed(size=5)  # no growth
    assert not any(event.is_set() for event in events)
    changes.committed(cosigned=[(5, "c")])
    assert _woken(thread, result)
    assert not any(event.is_set() for event in _registered(changes, 2))
    changes.committed(size=6, cosigned=[(6, "d")])
    assert _woken(other, other_result) and _woken(growth, growth_result)
    assert not changes._waiting and not changes._for_cosigners and not changes._for_growth


def test_a_growth_wait_wakes_when_the_log_grows_past_the_size_it_saw() -> None:
    changes = LogChanges(size=5)
    thread, result = _waiting(changes, grown_past=5)
    changes.committed(size=5)  # a commit that appended nothing
    thread.join(0.2)
    assert thread.is_alive()
    changes.committed(size=6)
    assert _woken(thread, result)


def test_a_met_condition_returns_at_once_and_an_unmet_one_times_out_false() -> None:
    changes = LogChanges(size=7)
    assert changes.wait(
        checkpoint=5, cosigners=(), want_cosigners=0, grown_past=6, timeout_s=LONG_S
    )
    changes.committed(cosigned=[(5, "a"), (5, "b")])
    assert changes.wait(
        checkpoint=5, cosigners=("c",), want_cosigners=3, grown_past=0, timeout_s=LONG_S
    )
    _stays_waiting(changes, lambda: changes.committed(cosigned=[(6, "z")]), want_cosigners=3)
    _stays_waiting(changes, lambda: changes.committed(size=7), grown_past=7)
    # Neither condition asked for: nothing but the store's closing ends the wait.
    _stays_waiting(changes, lambda: changes.committed(size=9, cosigned=[(5, "d")]))


def test_closing_wakes_every_waiter_and_later_waits_return_at_once() -> None:
    changes = LogChanges(size=3)
    waiters = [_waiting(changes, want_cosigners=2), _waiting(changes, grown_past=3)]
    changes.close()
    assert all(_woken(thread, result) for thread, result in waiters)
    assert changes.wait(
        checkpoint=3, cosigners=(), want_cosigners=9, grown_past=0, timeout_s=LONG_S
    )


def test_only_the_newest_checkpoints_cosigners_are_kept() -> None:
    changes = LogChanges()
    for size in range(1, KEPT_CHECKPOINTS + 11):
        changes.committed(size=size, cosigned=[(size, "a")])
    assert not changes.wait(
        checkpoint=1, cosigners=(), want_cosigners=1, grown_past=0, timeout_s=0.01
    )  # dropped: only a wake-up hint, the held call answers from the store
    newest = KEPT_CHECKPOINTS + 10
    assert changes.wait(
        checkpoint=newest, cosigners=(), want_cosigners=1, grown_past=0, timeout_s=0.01
    )


def test_the_store_tells_what_a_transaction_committed_and_nothing_it_rolled_back(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state", federation_id="fed-wait")
    store.append_log("run-ended", {"run_id": "r0"})
    size = store.log_size()
    assert size
    thread, result = _waiting(store.log_changes, grown_past=size)
    with pytest.raises(RuntimeError), store.transaction():
        store.append_log("run-ended", {"run_id": "r1"})
        raise RuntimeError("the transition failed")
    with store.transaction():  # an inner block that fails is undone with what it told
        with pytest.raises(RuntimeError), store.transaction():
            store.append_log("run-ended", {"run_id": "r1"})
            store.put_log_cosignature(size=size, root=b"r" * 32, witness="s9", signature=b"s")
            raise RuntimeError("the inner step failed")
        store.audit("noted", {})
    (event,) = _registered(store.log_changes, 1)
    assert not event.is_set()  # rolled back: the log did not grow
    assert not store.log_changes.wait(
        checkpoint=size, cosigners=(), want_cosigners=1, grown_past=0, timeout_s=0.01
    )  # nor was the rolled-back cosignature told
    with store.transaction():
        store.append_log("run-ended", {"run_id": "r1"})
        thread.join(0.2)
        assert thread.is_alive()  # not before the commit
    assert _woken(thread, result)
    cosigned, cosigned_result = _waiting(store.log_changes, checkpoint=size + 1, want_cosigners=1)
    store.put_log_cosignature(size=size + 1, root=b"r" * 32, witness="s1", signature=b"s")
    assert _woken(cosigned, cosigned_result)
    late = _waiting(store.log_changes, want_cosigners=5)
    store.close()
    assert _woken(*late)


def test_the_pool_spares_one_held_call_per_site_and_fewer_when_it_is_set_smaller() -> None:
    """Held calls never take the threads the sites' streams and other calls need (M-236): the
    default pool has one per site on top; a configured pool holds only what it spares."""
    per_site = 2 + 2 + 2  # watches, uploads, downloads by default
    assert worker_threads(StreamLimits(), sites=8) == 8 * (per_site + 1) + UNARY_WORKERS
    assert held_calls(StreamLimits(), sites=8) == 8
    assert held_calls(StreamLimits(), sites=1) == 1  # the 32-thread floor spares more: one a site
    spare3 = StreamLimits(worker_threads=8 * per_site + UNARY_WORKERS + 3)
    assert held_calls(spare3, sites=8) == 3
    assert held_calls(StreamLimits(worker_threads=10), sites=8) == 0
