"""The modes' view of the coordinator's durable state (:class:`~afl.server.modes.base.RoundContext`)
over the :class:`~afl.server.store.Store`: what a mode reads of a round, and the journal where a
secure mode persists every message before acknowledging it (docs/architecture.md §2). The round
machine (:mod:`afl.server.rounds`) is one."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from afl.core.row_bounds import RowBounds
from afl.server.plan.history import history_audit
from afl.server.plan.release import PlannedRelease, RoundView
from afl.server.store import MessageRow, Store, UploadRow

__all__ = ["StoreContext"]


class StoreContext:
    """A :class:`~afl.server.modes.base.RoundContext` over ``store`` and ``clock`` (set by the
    subclass)."""

    store: Store
    clock: Callable[[], float]
    #: round -> {release: the sites in its decoded sum} of rounds whose sums were decoded and
    #: not yet logged as released (:meth:`note_decoded`; the round machine logs them).
    decoded: dict[str, dict[str, tuple[str, ...]]]

    def note_decoded(self, round_id: str, contributors: Mapping[str, Sequence[str]]) -> None:
        self.decoded[round_id] = {name: tuple(sites) for name, sites in contributors.items()}

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def decisions(self, round_id: str) -> dict[str, tuple[bool, str]]:
        return self.store.decisions(round_id)

    def uploads(self, round_id: str) -> dict[tuple[str, str], UploadRow]:
        return self.store.uploads(round_id)

    def site_uploads(self, round_id: str, site_id: str) -> dict[str, UploadRow]:
        return self.store.site_uploads(round_id, site_id)

    def read_payload(self, row: UploadRow) -> bytes:
        return self.store.read_payload(row)

    def put_message(
        self, round_id: str, *, stage: int, site_id: str, kind: str, data: bytes
    ) -> None:
        self.store.put_message(round_id, stage=stage, site_id=site_id, kind=kind, data=data)

    def messages(self, round_id: str) -> list[MessageRow]:
        return self.store.messages(round_id)

    def audit(self, event: str, detail: Mapping[str, object]) -> None:
        self.store.audit(event, detail)

    def row_bounds(self, site_id: str) -> RowBounds | None:
        enrolment = self.store.enrolment(site_id)
        return None if enrolment is None else enrolment.row_bounds

    def exposes_history(
        self, view: RoundView, releases: Sequence[PlannedRelease], members: Sequence[str]
    ) -> str:
        """The refusal when ``releases`` summed over ``members`` expose a site together with the
        federation's earlier releases, its "plan-audit-history" record written (M-124)."""
        refusal, detail = history_audit(
            self.store, round_id=view.round_id, releases=releases, members=members
        )
        if detail is not None:
            self.store.audit("plan-audit-history", detail)
        return refusal
