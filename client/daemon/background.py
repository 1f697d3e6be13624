"""One step of a site's round run in a background thread while the round goes on: the round
joins it where its result is needed (:meth:`Background.wait` returns it, or re-raises what the
step raised), and in a ``finally`` on every other path (:meth:`Background.error`), so no thread
outlives the part of the round that started it.

The site runs three federation-log steps this way (their rules: docs/protocol.md §11a, M-193,
M-195, M-230; the order of a round: docs/architecture.md): the DP-ledger statement, logged while
a masked round's keys and shares go (:meth:`afl.client.daemon.anchor.LedgerAnchor.
start_publishing`); the log's check of a new plan (the site cosigns the checkpoint that holds it,
waits for the roster's quorum and verifies the plan's inclusion) while the site checks the plan
itself (:class:`afl.client.daemon.loop.PlanLogCheck`); and the check of a published round's
`release` statement, while the site verifies the model. (A masked round's `opening`, M-232, is
waited for in the round's own thread, at the unmask stage: :mod:`afl.client.daemon.opening`.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Background"]

T = TypeVar("T")


class Background(Generic[T]):
    """``step`` running in a daemon thread named ``name``."""

    def __init__(self, step: Callable[[], T], *, name: str) -> None:
        self._error: BaseException | None = None
        self._result: T | None = None
        self._thread = threading.Thread(target=self._run, args=(step,), name=name, daemon=True)
        self._thread.start()

    def _run(self, step: Callable[[], T]) -> None:
        try:
            self._result = step()
        except BaseException as exc:  # re-raised by wait, in the caller's thread
            self._error = exc

    def wait(self) -> T:
        """Once the step ended: what it returned; raise what it raised (every time)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]  # set: the step returned

    def error(self) -> BaseException | None:
        """Once the step ended: what it raised (None: it completed)."""
        self._thread.join()
        return self._error

    def join(self, *, raising: type[BaseException]) -> None:
        """Once the step ended: raise what it raised if that is a ``raising`` (evidence that must
        stop the site whatever else went wrong), else nothing; for a ``finally``."""
        error = self.error()
        if isinstance(error, raising):
            raise error
