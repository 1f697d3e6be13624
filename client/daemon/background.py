"""One step of a site's round run in a background thread while the round goes on: the round
joins it where its result is needed (:meth:`Background.wait` re-raises what the step raised) and
before the round ends (:meth:`Background.error`), so no thread outlives its round.

The site runs three log steps this way (docs/protocol.md §11a): the DP-ledger statement, logged
while a masked round's keys and shares go (:meth:`afl.client.daemon.anchor.LedgerAnchor.
start_publishing`); the witnessing of the checkpoint that holds a new plan, while the site checks
the plan (so the roster's quorum gathers meanwhile); and the check of a published round's
`release` statement, while the site verifies the model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Background"]


class Background:
    """``step`` running in a daemon thread named ``name``."""

    def __init__(self, step: Callable[[], None], *, name: str) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(step,), name=name, daemon=True)
        self._thread.start()

    def _run(self, step: Callable[[], None]) -> None:
        try:
            step()
        except BaseException as exc:  # re-raised by wait, in the caller's thread
            self._error = exc

    def wait(self) -> None:
        """Return once the step ended; raise what it raised (every time this is called)."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def error(self) -> BaseException | None:
        """Once the step ended: what it raised (None: it completed)."""
        self._thread.join()
        return self._error
