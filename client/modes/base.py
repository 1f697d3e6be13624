"""Aggregation modes of the site daemon: the declared interface, and the ``plaintext`` mode
(docs/architecture.md §3, §4).

The daemon's round loop (:mod:`afl.client.daemon.loop`) is the same for every mode: verify the signed
plan, check it against the site's policy, compute the payloads, then hand them to the round's
:class:`AggregationMode`, which

* :meth:`~AggregationMode.encode`\\ s one release's float64 values as the plan's encoding asks
  (refusing values outside a declared bound: never clipped), and
* :meth:`~AggregationMode.exchange`\\ s everything between the accepted plan and the model: the
  uploads, and for the secure modes their key exchange, tags or unmasking, starting once the
  round reaches :attr:`~AggregationMode.first_stage`.

A mode talks to the coordinator only through the :class:`RoundSession` it is given (the verified
plan, this site's identity key, the peers' keys from the startup kit and the daemon's
:class:`~afl.client.daemon.rpc.CoordinatorClient`). The modes are listed in
:mod:`afl.client.modes.registry`.

``plaintext`` (this module): float64 statistics over TLS, one chunked upload per slot.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from numpy.typing import NDArray

from afl.client.daemon.rpc import CoordinatorClient
from afl.client.payloads.stats import PayloadError, SlotPayload, encode_float64
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = [
    "AggregationMode",
    "PlaintextMode",
    "RoundSession",
    "UploadRecord",
    "skipped_record",
    "upload_record",
]


@dataclass(frozen=True)
class RoundSession:
    """What a mode needs to talk to the coordinator during one round."""

    rpc: CoordinatorClient
    round_id: str
    site_id: str
    plan: cpb.ReleasePlan
    identity_key: Ed25519PrivateKey
    peer_keys: Mapping[str, bytes] = field(default_factory=dict)
    #: The site's [policy] as the modes need it: the pinned CKKS decryptor, and the fewest
    #: surviving members per MASK release (:func:`afl.client.policy.plan.survivor_floors`).
    ckks_decryptor: str | None = None
    survivor_floors: Mapping[str, int] = field(default_factory=dict)
    #: SHA-256 of the signed plan's exact bytes (what signed tags and decisions bind).
    plan_sha256: bytes = b""
    #: MASK with a sparse graph: the nonce this site committed to when it accepted the plan.
    graph_nonce: bytes = b""
    #: MASK: called with the survivor list before this site signs it or sends an unmask share;
    #: it records the survivors and raises to refuse (docs/protocol.md M-205); it returns the
    #: site's signed `opening` statement over them (M-232) that the consistency signature
    #: carries (b"": none).
    survivors_check: Callable[[Sequence[str]], bytes] | None = None
    #: Called before each upload of the site's statistics; it returns once the round's DP-ledger
    #: statement is in the federation log (docs/protocol.md M-195), which the daemon logs
    #: meanwhile, so messages without statistics (MASK's keys and shares) need not wait for it.
    before_statistics: Callable[[], None] | None = None
    #: MASK: called before this site's unmask shares are computed or sent; it returns once the
    #: site's `opening` statement of the round is in a quorum-cosigned checkpoint of the
    #: federation log (docs/protocol.md M-232), which the consistency signature carried.
    before_unmask: Callable[[], None] | None = None
    #: CKKS: the decryptor's verified public context and its announcement, fetched ahead by the
    #: daemon (:class:`afl.client.modes.ckks.ContextPrefetch`); None: the exchange fetches it.
    ckks_context: Callable[[], tuple[Any, pb.CkksContextAnnouncement]] | None = None
    #: CKKS: given the verified context's SHA-256, where the encryption takes its encryptions of
    #: zero drawn ahead (:meth:`afl.client.modes.ckks.ZeroFiller.zeros_for`); None: none.
    ckks_zeros: Callable[[bytes], Callable[[], Any | None]] | None = None
    #: Where the exchange's time went, by step (seconds; the site's round report shows them).
    timings: dict[str, float] = field(default_factory=dict)
    #: CKKS: the ciphertexts encrypted, and those made from an encryption of zero drawn ahead
    #: (the round report's ``ckks``).
    ckks_counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class UploadRecord:
    """One message or upload slot as sent (for the local report)."""

    slot: str
    releases: tuple[str, ...]
    bytes: int
    sha256: str
    chunks: int
    duplicate: bool
    skipped: bool
    seconds: float

    def to_json(self) -> dict[str, object]:
        return {
            "slot": self.slot,
            "releases": list(self.releases),
            "bytes": self.bytes,
            "sha256": self.sha256,
            "chunks": self.chunks,
            "duplicate": self.duplicate,
            "already_complete": self.skipped,
            "seconds": round(self.seconds, 6),
        }


def upload_record(
    session: RoundSession, slot: str, releases: tuple[str, ...], data: bytes
) -> UploadRecord:
    """Upload ``data`` to ``slot`` of the session's round (once the session's
    ``before_statistics`` returned); the record of what was sent."""
    if session.before_statistics is not None:
        session.before_statistics()
    start = time.perf_counter()
    receipt = session.rpc.upload(data, round_id=session.round_id, release_name=slot)
    return UploadRecord(
        slot=slot,
        releases=releases,
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        chunks=wire.chunk_count(len(data)),
        duplicate=bool(receipt.duplicate),
        skipped=False,
        seconds=time.perf_counter() - start,
    )


def skipped_record(item: SlotPayload) -> UploadRecord:
    """The record of a slot the server already holds (a resumed round)."""
    return UploadRecord(item.slot, item.releases, 0, item.sha256, 0, True, True, 0.0)


class AggregationMode(Protocol):
    """How one aggregation mode encodes and exchanges a site's releases (module docstring)."""

    name: str
    aggregation: int
    first_stage: int

    def encode(self, release: cpb.Release, values: NDArray[np.float64]) -> bytes:
        """Wire bytes of the site's contribution to ``release``."""
        ...

    def exchange(
        self,
        session: RoundSession,
        payloads: Sequence[SlotPayload],
        *,
        already_complete: Collection[str] = (),
    ) -> list[UploadRecord]:
        """Everything between the accepted plan and the model (uploads, keys, shares...)."""
        ...


class PlaintextMode:
    """``plaintext``: float64 little-endian statistics, one chunked upload per slot."""

    name: str = "plaintext"
    aggregation: int = int(cpb.AGGREGATION_MODE_PLAINTEXT)
    first_stage: int = int(pb.ROUND_STAGE_UPLOAD)

    def encode(self, release: cpb.Release, values: NDArray[np.float64]) -> bytes:
        if release.encoding.dtype not in (cpb.DTYPE_FLOAT64_LE, cpb.DTYPE_UNSPECIFIED):
            dtype = cpb.DType.Name(release.encoding.dtype)
            raise PayloadError(f"release {release.name}: plaintext mode needs float64, not {dtype}")
        return encode_float64(values)

    def exchange(
        self,
        session: RoundSession,
        payloads: Sequence[SlotPayload],
        *,
        already_complete: Collection[str] = (),
    ) -> list[UploadRecord]:
        return [
            skipped_record(item)
            if item.slot in already_complete
            else upload_record(session, item.slot, item.releases, item.payload)
            for item in payloads
        ]
