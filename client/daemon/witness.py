"""What this site has seen of the coordinator's state, so that a restored old backup is noticed
(docs/protocol.md M-142, docs/operations.md §9).

``state_dir/witness.json`` (written atomically, BEFORE the site acts on what it records) holds

* ``completed``: round id -> [run id, round number] of every round this site completed (it
  verified the round's model);
* ``joined``: the same for every round this site took part in (recorded before its plan decision
  and uploads leave);
* ``models``: the coordinator's latest-model round ids in the order the site saw them;
* ``acknowledged``: the count of restores the coordinator's operator acknowledged, as last seen.

Every ``GetStatus`` answer is checked (:meth:`Witness.observe`). The coordinator is BEHIND what
this site has seen, and the site refuses to go on (:class:`RestoreDetected`, one line), when

* it offers a round this site completed in any stage but PUBLISHED;
* it offers a round of a run with a number at or below one this site completed in that run,
  under another round id (the run was rolled back and redone);
* its latest model is none, or one this site saw before a later one.

Once the operator acknowledges the restore (``afl-server ack-restore``; the coordinator's
``restores_acknowledged`` grows) the site logs it, forgets the run and model positions it holds
(the coordinator starts from the restored state) and takes part again; a round it completed is
never taken part in again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from afl.client.daemon.transport import DaemonError
from afl.client.payloads.stats import dump_json
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = ["RestoreDetected", "RoundIdReused", "Witness"]

log = logging.getLogger("afl.client")
WITNESS_NAME = "witness.json"


class RestoreDetected(DaemonError):
    """The coordinator claims an older state than this site has seen (module docstring)."""


class RoundIdReused(RestoreDetected):
    """The coordinator offers, in another run, a round id this site completed: no restore
    explains it (a restore brings back the run too), and no acknowledgement allows it."""


class Witness:
    """The site's record of the coordinator's state (module docstring)."""

    def __init__(self, state_dir: Path, *, site_id: str) -> None:
        self.path = Path(state_dir) / WITNESS_NAME
        self.site_id = site_id
        doc: dict[str, Any] = {}
        if self.path.is_file():
            try:
                doc = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise DaemonError(
                    f"{self.path} is unreadable ({exc}): restore it from the site's backup"
                ) from exc
        self.completed: dict[str, list[Any]] = dict(doc.get("completed", {}))
        self.joined: dict[str, list[Any]] = dict(doc.get("joined", {}))
        self.models: list[str] = list(doc.get("models", []))
        self.acknowledged = int(doc.get("acknowledged", 0))

    def _save(self) -> None:
        dump_json(
            self.path,
            {
                "completed": self.completed,
                "joined": self.joined,
                "models": self.models,
                "acknowledged": self.acknowledged,
            },
        )

    def join(self, status: pb.RoundStatus) -> None:
        """Record a round before taking part in it."""
        if status.round_id not in self.joined:
            self.joined[status.round_id] = [status.run_id, int(status.round_number)]
            self._save()

    def complete(self, status: pb.RoundStatus) -> None:
        """Record a round whose model this site verified (before its report leaves)."""
        self.completed[status.round_id] = [status.run_id, int(status.round_number)]
        self._save()

    def reused(self, response: pb.StatusResponse) -> str:
        """Why ``response`` offers a round id this site completed in another run ("" when it
        does not; a run id blanked by an acknowledged restore names no run)."""
        if not response.HasField("round"):
            return ""
        r = response.round
        run = self.completed.get(r.round_id, [""])[0]
        if not run or not r.run_id or r.run_id == run:
            return ""
        return (
            f"round {r.round_id} in {r.run_id}, and this site completed round {r.round_id} in "
            f"{run}: a round id names one round, ever"
        )

    def regression(self, response: pb.StatusResponse) -> str:
        """Why ``response`` is older than what this site has seen ("" when it is not)."""
        latest = response.latest_model_round_id
        if self.models and not latest:
            return f"it holds no model, and this site has seen its model of round {self.models[-1]}"
        if latest in self.models[:-1]:
            return (
                f"its latest model is that of round {latest}, and this site has seen the later "
                f"model of round {self.models[-1]}"
            )
        if not response.HasField("round"):
            return ""
        r = response.round
        final: tuple[int, ...] = (pb.ROUND_STAGE_PUBLISHED,)
        if r.round_id in self.completed and not self.completed[r.round_id][0]:
            final = (pb.ROUND_STAGE_PUBLISHED, pb.ROUND_STAGE_ABORTED)  # aborted at the ack
        if r.round_id in self.completed and r.stage not in final:
            stage = pb.RoundStage.Name(r.stage).removeprefix("ROUND_STAGE_")
            return f"it offers round {r.round_id} again ({stage}), which this site completed"
        for round_id, (run_id, number) in self.completed.items():
            if r.run_id == run_id and r.round_number <= number and r.round_id != round_id:
                return (
                    f"it offers round {r.round_number} of {run_id} as {r.round_id}, and this "
                    f"site completed round {number} of that run as {round_id}"
                )
        return ""

    def observe(self, response: pb.StatusResponse) -> None:
        """Check a status answer (module docstring); :class:`RestoreDetected` when the
        coordinator is behind what this site has seen. A new latest model is recorded."""
        if response.restores_acknowledged > self.acknowledged:
            log.warning(
                "site=%s the coordinator's operator acknowledged a restore of its state from a "
                "backup (restore %d): taking part again from the restored state",
                self.site_id,
                response.restores_acknowledged,
            )
            self.acknowledged = int(response.restores_acknowledged)
            self.models = []
            self.completed = {
                round_id: ["", 0]
                for round_id in self.completed  # never again, any run
            }
            self._save()
        reused = self.reused(response)
        if reused:
            raise RoundIdReused(
                f"the coordinator offers a round id it used before: {reused}. No restore explains "
                "it and this site takes no part in it; report it to the federation's operator "
                "with this site's log (docs/operations.md §5.1)"
            )
        reason = self.regression(response)
        if reason:
            raise RestoreDetected(
                f"the coordinator's state is older than this site has seen: {reason}. It was "
                "restored from an older backup; this site takes no part until the operator "
                "acknowledges the restore (afl-server ack-restore, docs/operations.md §9)"
            )
        latest = response.latest_model_round_id
        if latest and (not self.models or self.models[-1] != latest):
            self.models.append(latest)
            self._save()
