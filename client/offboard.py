"""`afl-client offboard`: a site leaving the federation deletes what it computed for it
(docs/operations.md §10.1, docs/protocol.md M-177).

Deleted (overwritten with zeros, then unlinked: :mod:`afl.core.erase`), each file listed with its
SHA-256 and size in a record ``state_dir/offboarding/<UTC time>.json`` (0600) written before the
command returns:

* ``state_dir/stats/``: the site's own statistics (its G and b, pseudo-label projections);
* the feature cache ``[data] cache`` and the hold-out cache ``[data] holdout``: per-image
  features derived from patient images (``--keep-cache`` keeps them, e.g. for another
  federation).

Kept, and said so in the record: ``dp-ledger/`` (the lifetime budget of this site's data: it must
outlive the federation as long as the data may be used again), ``history.json``,
``unmasked.json`` and ``reports/`` (which plans the site accepted and what it sent: no statistics), ``models/`` (the
published model), ``witness.json`` and the kit. The coordinator's side is ``afl-server
offboard``; the site's enrolment and audit records there stay (the audit chain is append-only).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path

from afl.client.config import ClientConfig
from afl.core.data.featurecache import FeatureCacheError, open_cache
from afl.core.erase import erase_tree
from afl.crypto.identity.pki import make_private_dir, write_private_file

__all__ = ["KEPT", "OffboardError", "Offboarding", "offboard_site", "planned_deletions"]

#: What offboarding keeps in the state folder, and why (written into the record).
KEPT = {
    "dp-ledger/": "the lifetime DP budget of this site's data (keep while the data may be used)",
    "history.json": "the plans this site accepted (releases, members; no statistics)",
    "unmasked.json": "the masked rounds this site helped unmask (releases, survivors; no statistics)",
    "reports/": "what this site sent in each round (sizes, outcomes; no statistics)",
    "models/": "the federation's published model",
    "witness.json": "what this site saw of the coordinator's state",
}


class OffboardError(ValueError):
    """Offboarding refused (the message names the path and why)."""


@dataclass(frozen=True)
class Offboarding:
    record: Path
    deleted: int
    bytes: int


def planned_deletions(config: ClientConfig, *, keep_cache: bool) -> list[Path]:
    """The folders :func:`offboard_site` erases (those that exist)."""
    paths = [config.state_dir / "stats"]
    if not keep_cache:
        paths += [config.data.cache] + ([config.data.holdout] if config.data.holdout else [])
    return [p for p in paths if p.exists()]


def offboard_site(config: ClientConfig, *, keep_cache: bool = False) -> Offboarding:
    """Erase :func:`planned_deletions` and write the record (module docstring).
    :class:`OffboardError` when a configured cache is not a feature cache (nothing is deleted
    then: a wrong ``[data] cache`` must not erase some other folder)."""
    targets = planned_deletions(config, keep_cache=keep_cache)
    for path in targets[1:]:
        try:
            open_cache(path, allow_partial=True)
        except (FeatureCacheError, OSError) as exc:
            raise OffboardError(
                f"{path} is not a feature cache ({exc}); nothing deleted: fix [data] in "
                f"{config.path} or use --keep-cache"
            ) from exc
    when = dt.datetime.now(dt.UTC)
    deleted = {str(path): erase_tree(path) for path in targets}
    record = {
        "site_id": config.site_id,
        "federation_id": config.federation_id,
        "time": when.isoformat(timespec="seconds"),
        "deleted": deleted,
        "kept": KEPT,
        "coordinator": "afl-server offboard deletes the site's data there; its enrolment and "
        "audit records stay (append-only audit chain)",
    }
    folder = make_private_dir(config.state_dir / "offboarding")
    path = folder / f"{when.strftime('%Y%m%dT%H%M%S%fZ')}.json"
    write_private_file(path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())
    files = [f for found in deleted.values() for f in found]
    return Offboarding(path, len(files), sum(int(str(f["size"])) for f in files))
