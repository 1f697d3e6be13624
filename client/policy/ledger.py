"""A site's lifetime privacy ledger (docs/protocol.md §7, docs/operations.md).

Every plan a site uploads under is recorded here BEFORE its first upload leaves the site: one
JSON file per entry in ``state_dir/dp-ledger/``, numbered, created atomically (temporary file,
fsync, hard link to a name that must not exist yet: an entry is never overwritten) and chained by
SHA-256 (each entry names its predecessor's digest), so the ledger is append-only, survives
restarts, and a changed, removed or reordered entry is detected (:class:`LedgerError`: the site
then refuses every plan until an operator looks; it never starts fresh silently). As for any hash
chain, removing or editing the LAST entry needs an anchor kept elsewhere: ``afl-client budget``
prints the head digest (:meth:`DpLedger.head`).

An entry holds what the accountant needs and nothing about the data: the round, its run (the
round-1 id of a round 2), the plan's SHA-256, the unit (``patient`` with m images, or ``image``),
δ, μ (this site's releases under the adversary view of :func:`afl.client.policy.dp.site_mu`;
inf for a plan without DP) and ε at δ, and each release's name, Δ and protecting σ.

Composition (:func:`afl.core.dp.accounting.compose_mu`): the μ-GDP releases of all entries
compose exactly into μ² = Σ μ_i²; ε at the site's lifetime δ. Entries of another unit than the
one asked for count as μ = inf (an image-level guarantee says nothing about a patient's images).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from afl.client.daemon.transport import DaemonError, check_round_id
from afl.core.dp.accounting import compose_mu, epsilon_from_mu
from afl.crypto.identity.pki import fsync_dir

__all__ = ["DpLedger", "LedgerEntry", "LedgerError", "LedgerSpend"]

_GENESIS = "0" * 64


class LedgerError(DaemonError):
    """The ledger is unreadable or its chain is broken (the message names the file)."""


@dataclass(frozen=True)
class LedgerEntry:
    """One recorded plan (module docstring). ``mu`` is inf for a plan without DP."""

    seq: int
    federation_id: str
    round_id: str
    round_number: int
    run_id: str
    plan_sha256: str
    aggregation: str
    unit: str
    images_per_patient: int
    delta: float
    mu: float
    epsilon: float
    releases: tuple[Mapping[str, Any], ...]
    recorded_unix_ms: int
    prev_sha256: str

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["releases"] = [dict(r) for r in self.releases]
        for key in ("mu", "epsilon"):
            out[key] = "inf" if math.isinf(out[key]) else out[key]
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> LedgerEntry:
        values = dict(raw)
        for key in ("mu", "epsilon"):
            values[key] = math.inf if values[key] == "inf" else float(values[key])
        values["releases"] = tuple(values["releases"])
        return cls(**values)

    def mu_for(self, unit: str) -> float:
        """This entry's μ for ``unit``: image-level entries bound no patient (inf)."""
        return self.mu if self.unit == unit or unit == "image" else math.inf


@dataclass(frozen=True)
class LedgerSpend:
    """What a site has spent: the composed μ over ``entries`` entries for ``unit``."""

    unit: str
    entries: int
    mu: float

    def epsilon(self, delta: float) -> float:
        return epsilon_from_mu(mu=self.mu, delta=delta)


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


class DpLedger:
    """The ledger folder ``root`` (``state_dir/dp-ledger``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _files(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.suffix == ".json")

    def entries(self) -> list[LedgerEntry]:
        """Every entry in order, after checking numbering and chain (:class:`LedgerError`)."""
        out: list[LedgerEntry] = []
        prev = _GENESIS
        for i, path in enumerate(self._files(), start=1):
            try:
                raw = path.read_bytes()
                entry = LedgerEntry.from_json(json.loads(raw))
            except (OSError, ValueError, TypeError, KeyError) as exc:
                raise LedgerError(f"DP ledger entry {path} is unreadable ({exc})") from exc
            if entry.seq != i or not path.name.startswith(f"{i:06d}-"):
                raise LedgerError(f"DP ledger {self.root}: entry {path.name} is out of sequence")
            if entry.prev_sha256 != prev:
                raise LedgerError(
                    f"DP ledger {self.root}: the chain breaks at {path.name} (an entry before "
                    "it was changed or removed)"
                )
            prev = _digest(raw)
            out.append(entry)
        return out

    def head(self) -> str:
        """SHA-256 of the last entry (the genesis value when empty): keep it off the site to
        detect a removed or edited last entry, which the chain alone cannot."""
        entries = self.entries()
        return _digest(self._files()[-1].read_bytes()) if entries else _GENESIS

    def entry_for(self, round_id: str) -> LedgerEntry | None:
        """The entry recorded for ``round_id`` (None if none)."""
        return next((e for e in self.entries() if e.round_id == round_id), None)

    def spent(self, *, unit: str, exclude_round: str = "") -> LedgerSpend:
        """The composition of every entry but ``exclude_round``'s, for ``unit``."""
        mine = [e for e in self.entries() if e.round_id != exclude_round]
        return LedgerSpend(unit, len(mine), compose_mu(e.mu_for(unit) for e in mine))

    def record(self, **fields: Any) -> LedgerEntry:
        """Append an entry (``LedgerEntry`` fields but seq, time and chain), durably; a second
        call for the same round and plan returns the first entry (a resumed round)."""
        entries = self.entries()
        for e in entries:
            if e.round_id == fields["round_id"] and e.plan_sha256 == fields["plan_sha256"]:
                return e
        prev = _GENESIS
        if entries:
            prev = _digest(self._files()[-1].read_bytes())
        entry = LedgerEntry(
            seq=len(entries) + 1,
            recorded_unix_ms=int(time.time() * 1000),
            prev_sha256=prev,
            **fields,
        )
        self._write(entry)
        return entry

    def restore(self, entries: list[LedgerEntry]) -> None:
        """Write ``entries`` (a whole ledger, e.g. rebuilt from this site's signed statements in
        the federation log) byte for byte as :meth:`record` wrote them, after the entries the
        folder already holds, which must be their prefix; the chain is checked afterwards."""
        have = self.entries()
        if [e.to_json() for e in have] != [e.to_json() for e in entries[: len(have)]]:
            raise LedgerError(
                f"DP ledger {self.root} holds {len(have)} entries that are not the first of the "
                f"{len(entries)} to restore: move it aside, then rebuild"
            )
        for entry in entries[len(have) :]:
            self._write(entry)
        self.entries()

    def _write(self, entry: LedgerEntry) -> None:
        """Create ``entry``'s file atomically; never overwrite one."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        name = f"{entry.seq:06d}-{check_round_id(entry.round_id)}.json"
        tmp = self.root / f".{name}.tmp"
        data = json.dumps(entry.to_json(), indent=2, sort_keys=True).encode("utf-8")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, self.root / name)  # fails if the name exists: never overwrite
        except FileExistsError as exc:
            raise LedgerError(f"DP ledger entry {self.root / name} already exists") from exc
        finally:
            tmp.unlink()
        fsync_dir(self.root)
