"""Site retention (docs/operations.md §10, docs/protocol.md M-179): ``[retention]`` of
client.toml, enforced by the site daemon at start-up and after each round.

* ``stats_days``: files of ``state_dir/stats/`` (the site's own G and b; recomputed from the
  feature cache when a round needs them) older than that are erased;
* ``reports_days``: round reports ``state_dir/reports/*.json`` older than that are erased (the
  upload register ``uploads/``, which keeps "one upload per round, ever", and ``history.json``
  stay: the cross-round audit and the replay rule need them);
* ``models_keep``: the newest that many verified models of ``state_dir/models/`` are kept, the
  older ones (signed model and its weights) erased.

Age is the file's modification time. Erased means overwritten with zeros and unlinked
(:mod:`afl.core.erase`); each pass that deletes anything writes ``state_dir/retention/<UTC
time>.json`` (0600) listing every file with its SHA-256 and size, and the settings it applied.
The DP ledger is never touched (it is what the lifetime budget counts).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

from afl.client.config import RetentionConfig
from afl.core.erase import erase_file
from afl.crypto.identity.pki import make_private_dir, write_private_file

__all__ = ["enforce_retention", "expired_files"]

_DAY_S = 86_400.0
_MODEL = ".signed-model.pb"


def _older(folder: Path, pattern: str, days: float | None, now: float) -> list[Path]:
    if days is None or not folder.is_dir():
        return []
    cutoff = now - days * _DAY_S
    return sorted(p for p in folder.glob(pattern) if p.is_file() and p.stat().st_mtime <= cutoff)


def expired_files(
    state_dir: Path, settings: RetentionConfig, *, now: float | None = None
) -> dict[str, list[Path]]:
    """What ``settings`` expires now, by setting (files only; nothing is deleted)."""
    now = time.time() if now is None else now
    found = {
        "stats_days": _older(state_dir / "stats", "*", settings.stats_days, now),
        "reports_days": _older(state_dir / "reports", "*.json", settings.reports_days, now),
        "models_keep": [],
    }
    models = state_dir / "models"
    if settings.models_keep is not None and models.is_dir():
        signed = sorted(
            models.glob(f"*{_MODEL}"), key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True
        )
        for path in signed[settings.models_keep :]:
            round_id = path.name.removesuffix(_MODEL)
            weights = models / f"{round_id}.weights.npy"
            found["models_keep"] += [path] + ([weights] if weights.is_file() else [])
    return found


def enforce_retention(
    state_dir: Path, settings: RetentionConfig, *, site_id: str, now: float | None = None
) -> Path | None:
    """Erase :func:`expired_files` and record them; the record's path, or None when nothing
    expired."""
    expired = expired_files(state_dir, settings, now=now)
    if not any(expired.values()):
        return None
    deleted = {
        key: [{**erase_file(path), "path": str(path.relative_to(state_dir))} for path in paths]
        for key, paths in expired.items()
        if paths
    }
    when = dt.datetime.now(dt.UTC)
    record = {
        "site_id": site_id,
        "time": when.isoformat(timespec="seconds"),
        "settings": {
            "stats_days": settings.stats_days,
            "reports_days": settings.reports_days,
            "models_keep": settings.models_keep,
        },
        "deleted": deleted,
        "kept": "dp-ledger/, history.json, uploads/ (the replay rule), witness.json",
    }
    folder = make_private_dir(state_dir / "retention")
    path = folder / f"{when.strftime('%Y%m%dT%H%M%S%fZ')}.json"
    write_private_file(path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())
    return path
