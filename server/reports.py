"""A site's ``ClientReport``, checked before anything of it is stored (docs/protocol.md §11).

A report is untrusted input: :func:`check_report` refuses (:class:`InvalidRequestError`, gRPC
INVALID_ARGUMENT, the message names the field) an outcome that is not one of the four
``ClientOutcome`` values, text beyond its length limit, too many warnings or timings, a timing or
budget value that is negative or NaN (a timing or δ also when infinite; ε = ∞ means no DP), and
a budget for another site. Only then does the coordinator store it and append the audit record,
in one transaction
(:meth:`afl.server.store.Store.put_report`). A site may report a round again (a restarted site
reports the round it finished); the new report replaces the stored one and its audit record
names the digest of the report it replaces, so the table and the log never disagree.
"""

from __future__ import annotations

import math

from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.errors import InvalidRequestError

__all__ = ["MAX_REASON_CHARS", "MAX_TIMINGS", "MAX_WARNINGS", "check_report"]

MAX_REASON_CHARS = 2000
MAX_WARNINGS = 256
MAX_WARNING_CHARS = 1000
MAX_TIMINGS = 64
MAX_NAME_CHARS = 100

_OUTCOMES = frozenset(
    (
        pb.CLIENT_OUTCOME_COMPLETED,
        pb.CLIENT_OUTCOME_REFUSED_PLAN,
        pb.CLIENT_OUTCOME_FAILED,
        pb.CLIENT_OUTCOME_ABORTED,
    )
)


def _non_negative(value: float, what: str, *, infinite: bool = False) -> None:
    if math.isnan(value) or value < 0 or (math.isinf(value) and not infinite):
        kind = "a number" if infinite else "a finite number"
        raise InvalidRequestError(f"report: {what} must be {kind} >= 0")


def _at_most(count: int, limit: int, what: str) -> None:
    if count > limit:
        raise InvalidRequestError(f"report: {what} exceeds {limit}")


def check_report(report: pb.ClientReport, *, site_id: str) -> None:
    """Refuse a malformed report of ``site_id`` (module docstring); return None if it is sound."""
    if report.outcome not in _OUTCOMES:
        raise InvalidRequestError(
            f"report: outcome {int(report.outcome)} is not a ClientOutcome this server knows"
        )
    _at_most(len(report.reason), MAX_REASON_CHARS, "the reason's length")
    _at_most(len(report.warnings), MAX_WARNINGS, "the number of warnings")
    _at_most(max(map(len, report.warnings), default=0), MAX_WARNING_CHARS, "a warning's length")
    _at_most(len(report.software_version), MAX_NAME_CHARS, "software_version's length")
    _at_most(len(report.timings_s), MAX_TIMINGS, "the number of timings")
    for phase, seconds in report.timings_s.items():
        if not phase or len(phase) > MAX_NAME_CHARS:
            raise InvalidRequestError("report: a timing has an empty or overlong phase name")
        _non_negative(seconds, f"timing {phase[:40]!r}")
    if report.HasField("budget"):
        budget = report.budget
        if budget.site_id not in ("", site_id):
            raise InvalidRequestError("report: the budget names another site")
        _non_negative(budget.epsilon, "budget epsilon", infinite=True)  # no DP: ε = ∞
        _non_negative(budget.delta, "budget delta")
