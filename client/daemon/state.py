"""The afl-client daemon's state folder (docs/architecture.md §8: the client resumes
after a crash).

    state_dir/
      stats/local-<key>.npz           round-1 statistics (afl.client.payloads.stats)
      stats/pseudo-<key>.npz          round-2 pseudo-label projections
      history.json                    releases of every plan this site accepted (cross-round audit),
                                      with the survivors each was unmasked over once known
      unmasked.json                   each masked round this site signed survivors of (and so
                                      helped unmask), as a log `release` statement states it
                                      (afl.client.policy.loghistory.with_unmasked)
      uploads/<round>.json            the rounds this site sent statistics to, recorded before the
                                      first byte left (afl.client.policy.uploads: one upload per
                                      round, ever)
      models/<round>.signed-model.pb  the verified SignedModel as received
      models/<round>.weights.npy      its W (float64, d x C)
      reports/<round>.json            the local report of each round (what was sent, timings...)
      witness.json                    what this site has seen of the coordinator's state
                                      (afl.client.daemon.witness: a restored backup is noticed)

Every file is written atomically (temporary file + rename).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.client.daemon.report import RoundReport
from afl.client.daemon.transport import DaemonError, check_round_id
from afl.client.payloads.stats import dump_json
from afl.client.policy.loghistory import release_fields
from afl.client.policy.plan import PolicyDecision, audit_view
from afl.client.policy.uploads import UploadRegister
from afl.core import leakage
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = ["DaemonState", "plan_summary"]


class DaemonState:
    """Read and write the state folder of one site."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def history_path(self) -> Path:
        return self.root / "history.json"

    def _history_rows(self) -> list[dict[str, Any]]:
        if not self.history_path.exists():
            return []
        rows: list[dict[str, Any]] = json.loads(self.history_path.read_text(encoding="utf-8"))[
            "releases"
        ]
        return rows

    def history(
        self, *, exclude_round: str, only: Collection[str] | None = None, planned: bool = False
    ) -> list[leakage.Release]:
        """Releases of earlier rounds this site took part in (for the cross-round audit); with
        ``only``, of those rounds only. A release is summed over the survivors it was unmasked
        over when this site learned them (:meth:`record_survivors`), else over its planned
        members; with ``planned``, over its planned members always."""
        return [
            leakage.Release(
                r["name"],
                frozenset(r["members"] if planned else r.get("survivors", r["members"])),
                r["quantity"],
            )
            for r in self._history_rows()
            if r["round_id"] != exclude_round and (only is None or r["round_id"] in only)
        ]

    def remember(self, plan: cpb.ReleasePlan) -> None:
        """Record the releases of an accepted plan (names tagged with the round id; survivors
        already recorded for them are kept)."""
        every = self._history_rows()
        known = {
            r["name"]: r["survivors"]
            for r in every
            if r["round_id"] == plan.round_id and "survivors" in r
        }
        rows = [r for r in every if r["round_id"] != plan.round_id]
        for rel in audit_view(list(plan.releases), tag=f"{plan.round_id}/"):
            row: dict[str, Any] = {
                "round_id": plan.round_id,
                "name": rel.name,
                "members": sorted(str(m) for m in rel.members),
                "quantity": rel.quantity,
            }
            if rel.name in known:
                row["survivors"] = known[rel.name]
            rows.append(row)
        dump_json(self.history_path, {"releases": rows})

    def record_survivors(self, round_id: str, survivors: Collection[str]) -> None:
        """Record that ``round_id``'s releases are unmasked over ``survivors`` (each release:
        its members among them), durably, before this site helps unmask them."""
        alive = set(survivors)
        rows = self._history_rows()
        for r in rows:
            if r["round_id"] == round_id:
                r["survivors"] = sorted(m for m in r["members"] if m in alive)
        dump_json(self.history_path, {"releases": rows})

    @property
    def unmasked_path(self) -> Path:
        return self.root / "unmasked.json"

    def record_unmasking(self, plan: cpb.ReleasePlan, survivors: Collection[str]) -> None:
        """Record, durably and before this site signs ``survivors`` or sends an unmask share,
        that ``plan``'s releases may be unmasked over them (:func:`release_fields`)."""
        rounds = [r for r in self.unmasked() if r.get("round_id") != plan.round_id]
        rounds.append(release_fields(plan, survivors=survivors))
        dump_json(self.unmasked_path, {"rounds": rounds})

    def unmasked(self) -> list[dict[str, Any]]:
        """What :meth:`record_unmasking` recorded, oldest first (:class:`DaemonError` naming
        the file when it cannot be read: the whole-history audit then refuses plans)."""
        if not self.unmasked_path.exists():
            return []
        try:
            rounds = json.loads(self.unmasked_path.read_text(encoding="utf-8"))["rounds"]
            if not isinstance(rounds, list) or not all(
                isinstance(r, dict) and isinstance(r.get("round_id"), str) for r in rounds
            ):
                raise ValueError("not a list of release statements")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DaemonError(
                f"{self.unmasked_path} is unreadable ({exc}): restore it from the site's backup"
            ) from exc
        return rounds

    def survivors(self, round_id: str) -> set[str] | None:
        """The survivors this site recorded for ``round_id`` (:meth:`record_survivors`: the list
        it signed in a masked round's consistency check); None when it recorded none."""
        rows = [r for r in self._history_rows() if r["round_id"] == round_id]
        if not rows or not all("survivors" in r for r in rows):
            return None
        return {s for r in rows for s in r["survivors"]}

    def _rounds_where(self, keep: Callable[[dict[str, Any]], bool]) -> set[str]:
        """Round ids whose local report satisfies ``keep``."""
        found = set()
        for p in (self.root / "reports").glob("*.json"):
            try:
                report = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if keep(report):
                found.add(str(report.get("round_id")))
        return found

    def completed_rounds(self) -> set[str]:
        """Round ids whose local report says COMPLETED."""
        return self._rounds_where(lambda report: report.get("outcome") == "COMPLETED")

    @property
    def uploads(self) -> UploadRegister:
        """The register of rounds this site sent statistics to (one upload per round, ever)."""
        return UploadRegister(self.root / "uploads")

    def uploaded_rounds(self) -> set[str]:
        """Round ids this site sent statistics to (its sums may have been released), or that
        completed: the upload register's, and those its reports name."""
        return self.uploads.rounds() | self.reported_rounds()

    def reported_rounds(self) -> set[str]:
        """Round ids whose local report says this site sent statistics, or COMPLETED."""
        return self._rounds_where(
            lambda report: (
                report.get("outcome") == "COMPLETED" or int(report.get("bytes_sent") or 0) > 0
            )
        )

    def model_path(self, round_id: str) -> Path:
        return self.root / "models" / f"{check_round_id(round_id)}.weights.npy"

    def save_candidate(self, round_id: str, signed: pb.SignedModel) -> Path:
        """Keep a verified candidate (signed "candidate-model", not published) as
        ``candidates/<round>.signed-model.pb``: what this site may score in the gate."""
        check_round_id(round_id)
        folder = self.root / "candidates"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{round_id}.signed-model.pb"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(signed.SerializeToString())
        tmp.replace(path)
        return path

    def save_model(
        self, round_id: str, signed: pb.SignedModel, weights: NDArray[np.float64]
    ) -> Path:
        """Keep the verified model: the signed bytes as received and W as .npy."""
        check_round_id(round_id)
        models = self.root / "models"
        models.mkdir(parents=True, exist_ok=True)
        tmp = models / f"{round_id}.signed-model.pb.tmp"
        tmp.write_bytes(signed.SerializeToString())
        tmp.replace(models / f"{round_id}.signed-model.pb")
        path = self.model_path(round_id)
        with open(path.with_name(path.name + ".tmp"), "wb") as fh:
            np.save(fh, weights)
        path.with_name(path.name + ".tmp").replace(path)
        return path

    def write_report(self, report: RoundReport) -> Path:
        """reports/<round>.json (``no-round.json`` when no round was reached); the report of a
        round this site sent statistics to is never replaced by a later one that sent nothing
        (e.g. its refusal of the round offered again): that goes to
        ``reports/<round>.<outcome>.json``."""
        name = check_round_id(report.round_id) if report.round_id else "no-round"
        path = self.root / "reports" / f"{name}.json"
        if report.round_id and not report.bytes_sent and path.is_file():
            try:
                earlier = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                earlier = {}
            if int(earlier.get("bytes_sent") or 0) > 0:
                path = path.with_name(f"{name}.{(report.outcome or 'later').lower()}.json")
        dump_json(path, report.to_json())
        return path


def _enum_name(enum: Any, value: int) -> str:
    """The name of ``value`` in the protobuf ``enum``; ``UNKNOWN(value)`` for a value this
    release does not know (the RoundConfig's copies of the plan's fields are not signed)."""
    try:
        return str(enum.Name(value))
    except ValueError:
        return f"UNKNOWN({value})"


def plan_summary(
    cfg: pb.RoundConfig,
    plan: cpb.ReleasePlan | None,
    decision: PolicyDecision,
    plan_sha256: bytes,
) -> dict[str, Any]:
    """The report's record of the plan the site decided on (releases, audit, decision)."""
    return {
        "sha256": plan_sha256.hex(),
        "accepted": decision.accept,
        "reason": decision.reason,
        "aggregation": _enum_name(cpb.AggregationMode, cfg.aggregation),
        "gram_scope": _enum_name(cpb.GramScope, cfg.gram_scope),
        "participants": list(cfg.participants),
        "releases": [
            {
                "name": r.name,
                "upload_name": r.upload_name,
                "kind": cpb.StatisticKind.Name(r.kind),
                "members": list(r.member_site_ids),
                "classes": list(r.class_names),
                "shape": list(r.shape),
            }
            for r in (plan.releases if plan is not None else [])
        ],
        "audit": decision.audit,
        **_mask_graph(plan),
    }


def _mask_graph(plan: cpb.ReleasePlan | None) -> dict[str, Any]:
    """The plan's sparse masking graph for the report (nothing for the full graph)."""
    if plan is None or not plan.mask_graph.degree:
        return {}
    g = plan.mask_graph
    return {
        "mask_graph": {
            "degree": g.degree,
            "share_threshold": g.share_threshold,
            "colluders": g.colluders,
            "dropouts": g.dropouts,
            "failure_log2": g.failure_log2,
        }
    }
