"""A site's report of one round: filled in as the round goes (the daemon's
:mod:`afl.client.daemon.loop` and the Flower site's :mod:`afl.flower.site`), written once at its
end as ``state_dir/reports/<round>.json`` (:meth:`afl.client.daemon.state.DaemonState.
write_report`) and sent, in part, as the ``ClientReport`` (docs/architecture.md §3; the keys an
operator reads are listed in docs/operations.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from afl.client.modes.base import UploadRecord

__all__ = ["RoundReport"]


@dataclass
class RoundReport:
    """What this site did in one round and how it ended. Optional parts are left out of the
    JSON while unset: the plan the site decided on (:func:`afl.client.daemon.state.plan_summary`),
    the class-list note, the evaluation an evaluation round scored, the DP report
    (:func:`afl.client.policy.dp.dp_report`), the uploads, a gated run's candidate, the verified
    model."""

    site_id: str
    federation_id: str
    run_id: str
    round_id: str
    round_number: int
    timings_s: dict[str, float] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    transport: str = ""  # "flower" through the Flower app; "" (left out) for afl-client
    plan: dict[str, Any] | None = None
    classes_note: str = ""
    evaluation: dict[str, Any] | None = None
    round_warnings: list[str] = field(default_factory=list)  # this round's, besides the site's
    dp: dict[str, object] | None = None
    uploads: list[dict[str, Any]] | None = None
    candidate: dict[str, Any] | None = None  # a gated run's final model, not yet published
    model: dict[str, Any] | None = None
    outcome: str = ""
    reason: str = ""
    warnings: list[str] = field(default_factory=list)
    round_events_by_stream: int | None = None
    #: CKKS: the ciphertexts this site encrypted and, of them, those made from an encryption of
    #: zero drawn while it waited (afl.client.modes.ckks.ZeroFiller).
    ckks: dict[str, int] | None = None

    def sent(self, records: Iterable[UploadRecord]) -> None:
        """Note uploads that left this site (their records and bytes)."""
        records = list(records)
        self.uploads = [*(self.uploads or []), *(r.to_json() for r in records)]
        self.bytes_sent += sum(r.bytes for r in records)

    @property
    def verified(self) -> bool:
        """Whether the round's signed result (model, or evaluation) verified."""
        return self.model is not None or "sha256" in (self.evaluation or {})

    def to_json(self) -> dict[str, Any]:
        """The JSON document (key order as written since the first release)."""
        doc: dict[str, Any] = {
            "site_id": self.site_id,
            "federation_id": self.federation_id,
            "run_id": self.run_id,
            "round_id": self.round_id,
            "round_number": self.round_number,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "timings_s": dict(self.timings_s),
        }
        optional: dict[str, Any] = {
            "transport": self.transport or None,
            "plan": self.plan,
            "classes_note": self.classes_note or None,
            "evaluation": self.evaluation,
            "round_warnings": self.round_warnings or None,
            "dp": self.dp,
            "uploads": self.uploads,
            "candidate": self.candidate,
            "model": self.model,
            "ckks": self.ckks,
        }
        doc.update({key: value for key, value in optional.items() if value is not None})
        doc.update(outcome=self.outcome, reason=self.reason, warnings=list(self.warnings))
        if self.round_events_by_stream is not None:
            doc["round_events_by_stream"] = self.round_events_by_stream
        return doc
