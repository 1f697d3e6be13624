"""`afl-server status --config server.toml`: the coordinator's state on one screen, read from its
state folder without writing to it (safe while the server runs): enrolment of every provisioned
site, the current round and its stage, decisions and uploads (those whose payload files retention
deleted counted apart), the last model, and the last error since the last published round (an
abort reason, a refusal, or a site's failure report; an abort before a later publication is
history, not the current error).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.wire import stage_name
from afl.server.config import ServerConfig
from afl.server.store import RoundRow, Store

__all__ = ["status_lines"]


def _stage(stage: int) -> str:
    return stage_name(stage).removeprefix("ROUND_STAGE_")


def _when(ms: int, now_ms: int) -> str:
    left = (ms - now_ms) / 1000
    at = dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"{at} (in {left:.0f} s)" if left >= 0 else f"{at} ({-left:.0f} s ago)"


def _site_failures(store: Store, row: RoundRow) -> list[str]:
    out = []
    for site, raw in sorted(store.reports(row.round_id).items()):
        report = pb.ClientReport.FromString(raw)
        if report.outcome not in (pb.CLIENT_OUTCOME_COMPLETED, pb.CLIENT_OUTCOME_UNSPECIFIED):
            name = pb.ClientOutcome.Name(report.outcome).removeprefix("CLIENT_OUTCOME_")
            out.append(f"{site} reported {name}: {report.reason or '(no reason given)'}")
    return out


def status_lines(config: ServerConfig, *, now: Callable[[], float] | None = None) -> list[str]:
    """The screen (module docstring); :class:`afl.server.errors.StateError` without state."""
    now_ms = int((now or (lambda: dt.datetime.now(dt.UTC).timestamp()))() * 1000)
    store = Store(config.state_dir, federation_id=config.federation_id, read_only=True)
    try:
        enrolled = store.enrolments()
        rounds = store.rounds()
        model = store.model()
        lines = [f"federation {config.federation_id}  (state {config.state_dir})", "sites:"]
        for site, entry in sorted(config.sites.items()):
            row = enrolled.get(site)
            if row is None:
                lines.append(f"  {site:<20} NOT enrolled ({entry.role})")
                continue
            bounds = row.row_bounds
            declared = f"N <= {bounds.rows}, L <= {bounds.max_row_norm:g}" if bounds else "none"
            coverage = (
                f"labels {len(row.labelled_classes)} class(es)"
                if row.labelled_classes
                else "coverage not disclosed"  # [policy] disclose_coverage = false
            )
            lines.append(
                f"  {site:<20} enrolled ({entry.role}); {coverage}; "
                f"backbone {row.backbone or '-'}; declared bounds {declared}"
                + ("; RANDOM-INIT features" if row.random_init else "")
            )
        if not rounds:
            lines.append("round: none yet")
        else:
            current = rounds[-1]
            ended = current.stage in (pb.ROUND_STAGE_PUBLISHED, pb.ROUND_STAGE_ABORTED)
            lines.append(
                f"round {current.round_id} (number {current.number}): {_stage(current.stage)}"
                + ("" if ended else f"; stage deadline {_when(current.deadline_ms, now_ms)}")
            )
            decisions = store.decisions(current.round_id)
            uploads = store.uploads(current.round_id)
            for site in current.participants:
                decision = decisions.get(site)
                said = (
                    "no decision"
                    if decision is None
                    else ("accepted" if decision[0] else "REFUSED")
                )
                rows = [row for (s, _), row in uploads.items() if s == site]
                kept = sum(1 for row in rows if row.path.exists())
                gone = (  # retention ([retention] payload_days) deleted the payload files
                    f"; {len(rows) - kept} deleted by retention" if len(rows) > kept else ""
                )
                lines.append(f"  {site:<20} {said}; {kept} upload(s) stored{gone}")
        lines.append(f"last model: round {model[0]}" if model else "last model: none published yet")
        errors: list[str] = []
        for past in reversed(rounds):  # back to the last published round, not beyond it
            errors = _site_failures(store, past)
            if past.stage == pb.ROUND_STAGE_ABORTED:
                errors.insert(0, f"round {past.round_id} ABORTED: {past.abort_reason}")
            if errors or past.stage == pb.ROUND_STAGE_PUBLISHED:
                break
        lines.append("last error: " + ("; ".join(errors) if errors else "none"))
        return lines
    finally:
        store.close()
