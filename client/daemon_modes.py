"""Aggregation modes of the afl-client as strategy objects (design §6, §7, issue 4).

A mode decides how a release's values are encoded on the wire and what exchange with the
coordinator happens between the accepted plan and the model. The daemon's loop is the same for
every mode; ``PLAINTEXT`` (float64 statistics over TLS, the baseline the secure modes are
measured against) is the one implemented here. The masking (Bonawitz et al.) and CKKS modes plug
in by adding a strategy to :data:`STRATEGIES`.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np
from numpy.typing import NDArray

from afl.client.daemon_stats import PayloadError, SlotPayload, encode_float64
from afl.client.daemon_transport import MAX_CHUNK_BYTES, RetryPolicy, upload_payload
from afl.proto.v1 import common_pb2 as cpb

__all__ = [
    "STRATEGIES",
    "AggregationStrategy",
    "PlaintextStrategy",
    "RoundSession",
    "UploadRecord",
]


@dataclass(frozen=True)
class RoundSession:
    """What a mode needs to talk to the coordinator during one round."""

    stub: Any
    round_id: str
    site_id: str
    retry: RetryPolicy
    rpc_timeout_s: float
    upload_timeout_s: float
    metadata: tuple[tuple[str, str], ...] = ()
    # For modes with their own stages (MASK): the verified signed plan, this site's identity key,
    # the peers' identity keys from the startup kit and the daemon's CoordinatorClient.
    plan: Any = None
    identity_key: Any = None
    peer_keys: Mapping[str, bytes] = field(default_factory=dict)
    rpc: Any = None


@dataclass(frozen=True)
class UploadRecord:
    """One upload slot as sent (for the local report)."""

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


class AggregationStrategy(Protocol):
    """How one aggregation mode encodes and exchanges a site's releases."""

    name: str
    aggregation: int

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


class PlaintextStrategy:
    """PLAINTEXT: float64 little-endian statistics, one chunked upload per slot."""

    name: str = "plaintext"
    aggregation: int = int(cpb.AGGREGATION_MODE_PLAINTEXT)

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
        records = []
        for item in payloads:
            chunks = max(1, -(-len(item.payload) // MAX_CHUNK_BYTES))
            if item.slot in already_complete:
                records.append(
                    UploadRecord(item.slot, item.releases, 0, item.sha256, 0, True, True, 0.0)
                )
                continue
            start = time.perf_counter()
            receipt = upload_payload(
                session.stub,
                item.payload,
                round_id=session.round_id,
                release_name=item.slot,
                policy=session.retry,
                timeout_s=session.upload_timeout_s,
                metadata=session.metadata,
            )
            records.append(
                UploadRecord(
                    slot=item.slot,
                    releases=item.releases,
                    bytes=len(item.payload),
                    sha256=item.sha256,
                    chunks=chunks,
                    duplicate=bool(receipt.duplicate),
                    skipped=False,
                    seconds=time.perf_counter() - start,
                )
            )
        return records


STRATEGIES: dict[int, AggregationStrategy] = {
    int(cpb.AGGREGATION_MODE_PLAINTEXT): PlaintextStrategy(),
}


def _register_mask() -> None:
    from afl.client.mode_mask import MaskStrategy  # the MASK mode (design §6)

    # cast: mypy cannot match the Protocol across this import cycle (same signatures)
    STRATEGIES[int(cpb.AGGREGATION_MODE_MASK)] = cast(AggregationStrategy, MaskStrategy())


_register_mask()


def _register_ckks() -> None:
    from afl.client.mode_ckks import CkksClientStrategy  # the CKKS mode (design §7)

    # cast: mypy cannot match the Protocol across this import cycle (same signatures)
    STRATEGIES[int(cpb.AGGREGATION_MODE_CKKS)] = cast(AggregationStrategy, CkksClientStrategy())


_register_ckks()
