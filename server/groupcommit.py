"""Group commit: calls whose whole effect is one store transaction, committed together.

The coordinator holds one lock over its state, and every write commits with an fsync of the
database and of its anchor (:meth:`afl.server.store.Store.transaction`). When every site of a
round calls at once with a small write of its own (a cosignature of the same checkpoint, its
DP-ledger statement), those commits queue up behind the lock one by one, and every other call
of the round waits behind them.

:meth:`GroupCommit.run` queues the call's step; whichever caller takes the lock first runs every
step queued by then inside one outer transaction: one commit, one fsync, one anchor write for
the lot. Each step runs in a savepoint of its own: a step that raises one of the ``isolated``
errors (the refusals a request can earn: a signature that does not verify, a wrong root) undoes
only its own writes, and only its caller sees the error. Any other error (the database's own,
say) ends the whole batch: nothing of it is kept, and every caller gets the error, as each
would have from a transaction of its own that failed. Each caller returns only once the
transaction that holds its step has committed, so nothing is acknowledged before it is durable.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, Protocol, TypeVar

from afl.server.errors import StoppingError

__all__ = ["GroupCommit"]

T = TypeVar("T")


class _Transactional(Protocol):
    @property
    def in_transaction(self) -> bool: ...

    def transaction(self) -> AbstractContextManager[Any]: ...


class _Job(Generic[T]):
    __slots__ = ("done", "error", "result", "step")

    def __init__(self, step: Callable[[], T]) -> None:
        self.step = step
        self.done = False
        self.result: T | None = None
        self.error: BaseException | None = None


class GroupCommit:
    """Steps run under ``lock`` in one transaction of ``store`` with the steps queued beside them
    (module docstring). ``lock`` must be the lock every other writer of ``store`` holds;
    ``isolated``: the errors that fail only the step that raised them."""

    def __init__(
        self,
        store: _Transactional,
        lock: AbstractContextManager[Any],
        *,
        isolated: tuple[type[Exception], ...],
    ) -> None:
        self._store, self._lock, self._isolated = store, lock, isolated
        self._queue: list[_Job[Any]] = []
        self._mutex = threading.Lock()
        #: Batches committed (or failed) and steps run, for tests.
        self.batches = 0
        self.steps = 0

    def run(self, step: Callable[[], T]) -> T:
        """``step()`` in a committed transaction: its result, or what it (or the transaction)
        raised. ``step`` runs under the lock, possibly in another caller's thread."""
        job: _Job[T] = _Job(step)
        with self._mutex:
            self._queue.append(job)
        with self._lock:
            if not job.done:  # no caller took it yet: this one commits every step queued
                with self._mutex:
                    jobs, self._queue = self._queue, []
                self._commit(jobs)
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]  # set: the step returned

    def _commit(self, jobs: list[_Job[Any]]) -> None:
        try:
            if self._store.in_transaction:  # its commit would not be this batch's to make
                raise RuntimeError("a group commit runs outside any open transaction")
            with self._store.transaction():
                for job in jobs:
                    try:
                        with self._store.transaction():  # a savepoint: undoes only this step
                            job.result = job.step()
                    except self._isolated as exc:  # this step's caller raises it
                        job.error = exc
        except BaseException as exc:  # nothing of the batch is known to be kept
            for job in jobs:
                if job.error is None:
                    job.error, job.result = _for_caller(exc), None
            if not isinstance(exc, Exception):
                raise
        finally:
            for job in jobs:
                job.done = True
            self.batches += 1
            self.steps += len(jobs)


def _for_caller(exc: BaseException) -> BaseException:
    """What one caller of a failed batch raises: its own copy of ``exc`` (each caller's thread
    adds its frames to what it raises), or :class:`StoppingError` for an interruption, which
    only the thread it interrupted re-raises."""
    if not isinstance(exc, Exception):
        error: BaseException = StoppingError(f"the coordinator's commit was interrupted: {exc!r}")
    else:
        error = copy.copy(exc)
        error.__traceback__ = None
    error.__cause__ = exc
    return error
