"""One upload per round, ever: a site's register of the rounds it sent statistics to
(docs/protocol.md §9, M-200..M-203; docs/operations.md §9).

A coordinator restored from a copy taken before a round's uploads offers that round again; a
site that uploads again adds fresh DP noise to the same statistics (two noisy copies average
the noise away while the DP ledger, keyed by round, keeps one entry) or, without DP, lets the
coordinator sum them over another set of sites. So, BEFORE the first byte of a round's exchange
leaves, the site records the round here: ``state_dir/uploads/<round>.json`` (federation, run,
round, plan digest, each slot's releases and SHA-256), created with fsync and a hard link to a
name that must not exist yet (a record is never overwritten by another claim), next to the exact
bytes of each slot (``<round>/<n>.bin``) while the exchange is in progress. When the exchange
ends the record is marked sent (atomic replace) and the bytes are deleted.

The rule (:meth:`UploadRegister.refusal`, the one place; the gRPC daemon and the Flower site
both ask it), for a round the coordinator offers:

* no record: take part (a round an older report says this site uploaded to, from before the
  register, is refused);
* a record under another plan digest: refused (a round has one plan);
* a record whose every slot the coordinator already holds (``caller_uploads_complete``): take
  part; nothing is sent again (a restarted site resuming a round);
* a record marked sent, and the coordinator lacks a slot: refused, naming the round and the
  earlier upload (the coordinator lost what it was sent: a restore from an older backup);
* a record still in progress (the site stopped mid-exchange): resumed with the SAME bytes, read
  back from the register, never computed again (so never fresh noise), except for ``mask``,
  whose exchange cannot be resumed (its keys are gone): refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from afl.client.daemon.transport import DaemonError, check_round_id
from afl.client.payloads.stats import SlotPayload
from afl.crypto.identity.pki import fsync_dir, make_private_dir, write_private_file

__all__ = ["SentRound", "SentSlot", "UploadRegister", "UploadRegisterError"]


class UploadRegisterError(DaemonError):
    """A record is unreadable, or its kept bytes do not match it (the message names the file)."""


@dataclass(frozen=True)
class SentSlot:
    """One upload slot of a round as this site claimed it."""

    slot: str
    releases: tuple[str, ...]
    sha256: str
    bytes: int


@dataclass(frozen=True)
class SentRound:
    """The register's record of one round (module docstring); ``sent_unix_ms`` is 0 while the
    exchange is in progress."""

    federation_id: str
    run_id: str
    round_id: str
    round_number: int
    plan_sha256: str
    aggregation: str
    slots: tuple[SentSlot, ...]
    claimed_unix_ms: int
    sent_unix_ms: int = 0

    @property
    def sent(self) -> bool:
        return self.sent_unix_ms > 0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["slots"] = [{**asdict(s), "releases": list(s.releases)} for s in self.slots]
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SentRound:
        values = dict(raw)
        values["slots"] = tuple(
            SentSlot(str(s["slot"]), tuple(s["releases"]), str(s["sha256"]), int(s["bytes"]))
            for s in values["slots"]
        )
        return cls(**values)

    def describe(self) -> str:
        """The earlier upload in a few words (for the refusal)."""
        when = self.sent_unix_ms or self.claimed_unix_ms
        stamp = datetime.fromtimestamp(when / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        names = ", ".join(s.slot for s in self.slots) or "no slot"
        state = "sent" if self.sent else "begun"
        return (
            f"run {self.run_id}, {state} {stamp} under plan sha256 {self.plan_sha256[:16]}..., "
            f"{len(self.slots)} upload(s): {names}"
        )


class UploadRegister:
    """The folder ``state_dir/uploads`` (module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _path(self, round_id: str) -> Path:
        return self.root / f"{check_round_id(round_id)}.json"

    def _bytes_dir(self, round_id: str) -> Path:
        return self.root / check_round_id(round_id)

    def get(self, round_id: str) -> SentRound | None:
        """The record of ``round_id`` (None if this site never claimed it)."""
        path = self._path(round_id)
        if not path.is_file():
            return None
        try:
            return SentRound.from_json(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise UploadRegisterError(
                f"upload record {path} is unreadable ({exc}): restore it from the site's backup"
            ) from exc

    def rounds(self) -> set[str]:
        """Every round id this site claimed an upload to."""
        if not self.root.is_dir():
            return set()
        return {p.stem for p in self.root.glob("*.json") if not p.name.startswith(".")}

    def refusal(
        self,
        round_id: str,
        *,
        already_complete: Collection[str],
        plan_sha256: str = "",
        resumable: bool = True,
        reported: Collection[str] = (),
    ) -> str:
        """Why this site must not take part in ``round_id`` again ("" when it may; the rule of
        the module docstring). ``already_complete``: the slots the coordinator says it holds of
        this site; ``plan_sha256``: the plan offered now ("" before it is known);
        ``resumable``: False for a mode whose exchange cannot be resumed (``mask``);
        ``reported``: rounds older reports of this site say it uploaded to."""
        record = self.get(round_id)
        once = "a site sends a round's statistics once, never again (docs/operations.md §9)"
        if record is None:
            if round_id in reported and not already_complete:
                return (
                    f"round {round_id} is offered again, and this site's report of it says it "
                    f"uploaded to it before; {once}"
                )
            return ""
        if plan_sha256 and record.plan_sha256 != plan_sha256:
            return (
                f"round {round_id} is offered again under another plan (sha256 "
                f"{plan_sha256[:16]}...); this site uploaded to it before ({record.describe()}); "
                f"a round has one plan and {once}"
            )
        held = set(already_complete)
        missing = [s.slot for s in record.slots if s.slot not in held]
        if not missing:
            return ""  # nothing leaves again
        if record.sent:
            return (
                f"round {round_id} is offered again, and this site uploaded to it before "
                f"({record.describe()}); the coordinator no longer holds {', '.join(missing)} "
                f"(restored from an older backup?): {once}"
            )
        if not resumable:
            return (
                f"round {round_id} is offered again after this site began its masked exchange "
                f"({record.describe()}); a masked exchange is never resumed: {once}"
            )
        return ""  # an interrupted exchange: resumed with the same bytes (claim)

    def claim(
        self,
        *,
        federation_id: str,
        run_id: str,
        round_id: str,
        round_number: int,
        plan_sha256: str,
        aggregation: str,
        payloads: Sequence[SlotPayload],
        keep_bytes: bool = True,
    ) -> list[SlotPayload]:
        """Record the round before anything of its exchange leaves; the payloads to send.

        The first claim writes the record (and, with ``keep_bytes``, each slot's bytes) durably
        and returns ``payloads``. A later claim of the same round and plan (an interrupted
        exchange, resumed: :meth:`refusal` said so) returns the bytes kept at the first claim,
        whatever ``payloads`` holds now (a DP payload computed again has fresh noise); slots
        whose bytes were not kept come back empty (the coordinator holds them, they are not
        sent). :class:`UploadRegisterError` for another plan or kept bytes that do not match."""
        record = self.get(round_id)
        if record is None:
            return self._first_claim(
                SentRound(
                    federation_id=federation_id,
                    run_id=run_id,
                    round_id=round_id,
                    round_number=int(round_number),
                    plan_sha256=plan_sha256,
                    aggregation=aggregation,
                    slots=tuple(
                        SentSlot(p.slot, tuple(p.releases), p.sha256, len(p.payload))
                        for p in payloads
                    ),
                    claimed_unix_ms=int(time.time() * 1000),
                ),
                payloads,
                keep_bytes=keep_bytes,
            )
        if record.plan_sha256 != plan_sha256:
            raise UploadRegisterError(
                f"round {round_id}: this site claimed its upload under another plan "
                f"({record.describe()})"
            )
        return [self._kept(record, i, s) for i, s in enumerate(record.slots)]

    def _first_claim(
        self, record: SentRound, payloads: Sequence[SlotPayload], *, keep_bytes: bool
    ) -> list[SlotPayload]:
        make_private_dir(self.root)
        if keep_bytes and payloads:
            folder = make_private_dir(self._bytes_dir(record.round_id))
            for i, p in enumerate(payloads):
                write_private_file(folder / f"{i}.bin", p.payload)
            fsync_dir(folder)
        path = self._path(record.round_id)
        tmp = write_private_file(
            self.root / f".{path.name}.claim",
            json.dumps(record.to_json(), indent=2, sort_keys=True).encode("utf-8"),
        )
        try:
            os.link(tmp, path)  # fails if a record exists: a claim is never overwritten
        except FileExistsError as exc:
            raise UploadRegisterError(f"upload record {path} already exists") from exc
        finally:
            tmp.unlink()
        fsync_dir(self.root)
        return list(payloads)

    def _kept(self, record: SentRound, index: int, slot: SentSlot) -> SlotPayload:
        path = self._bytes_dir(record.round_id) / f"{index}.bin"
        if not path.is_file():
            return SlotPayload(slot.slot, slot.releases, b"", slot.sha256)
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != slot.sha256:
            raise UploadRegisterError(
                f"{path} does not match the digest recorded for upload {slot.slot} of round "
                f"{record.round_id}: it will not be sent"
            )
        return SlotPayload(slot.slot, slot.releases, data, slot.sha256)

    def finish(self, round_id: str) -> SentRound:
        """Mark the round's exchange as ended (atomic replace, fsync) and delete its kept
        bytes: from now on a coordinator that lacks a slot of it is refused."""
        record = self.get(round_id)
        if record is None:
            raise UploadRegisterError(f"round {round_id}: no upload was claimed")
        if not record.sent:
            done = replace(record, sent_unix_ms=int(time.time() * 1000))
            path = self._path(round_id)
            write_private_file(
                path, json.dumps(done.to_json(), indent=2, sort_keys=True).encode("utf-8")
            )
            fsync_dir(self.root)
            record = done
        folder = self._bytes_dir(round_id)
        if folder.is_dir():
            for p in folder.iterdir():
                p.unlink()
            folder.rmdir()
        return record
