"""The round events the coordinator announces to watching sites (WatchRound), each only after
the transaction that made it has committed (docs/architecture.md §2, "The life of a round at the
coordinator"). The round machine (:mod:`afl.server.rounds`) opens every transition with
:meth:`RoundEvents.transition`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.daemon.observability import ServerMetrics
from afl.server.store import Store

__all__ = ["RoundEvents"]


class RoundEvents:
    """The announced events (``events``, numbered from 1) and those of the open transition."""

    def __init__(
        self,
        store: Store,
        lock: threading.Condition,
        metrics: ServerMetrics,
        now_ms: Callable[[], int],
    ) -> None:
        self.store, self.lock, self.metrics, self.now_ms = store, lock, metrics, now_ms
        self.events: list[pb.RoundEvent] = []
        self._pending: list[pb.RoundStatus] | None = None

    @contextmanager
    def transition(self) -> Iterator[None]:
        """One :meth:`Store.transaction` (re-entrant): the events emitted inside it are announced
        once it has committed, and never when it rolls back."""
        outer = self._pending is None
        pending: list[pb.RoundStatus] = [] if self._pending is None else self._pending
        self._pending = pending
        try:
            with self.store.transaction():
                yield
            for status in pending if outer else ():
                self._announce(status)
        finally:
            if outer:
                self._pending = None

    def emit(self, status: pb.RoundStatus) -> None:
        """Announce a round's status (after the open transition, if any, commits)."""
        if self._pending is not None:
            self._pending.append(status)
        else:
            self._announce(status)

    def _announce(self, status: pb.RoundStatus) -> None:
        self.metrics.set_stage(status.stage)
        sequence = len(self.events) + 1
        self.events.append(
            pb.RoundEvent(sequence=sequence, time_unix_ms=self.now_ms(), status=status)
        )
        self.lock.notify_all()
