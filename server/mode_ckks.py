"""CKKS aggregation on the server: public context, ciphertext checks, per-release sums (design §7).

The server never holds a secret key. It keeps the decryptor's PUBLIC context (checked with
:func:`afl.crypto.ckks.ensure_public`: a context holding a secret key is refused, and a server
configured or restarted with one refuses to start), checks every uploaded ciphertext list
against the release's layout, forms the homomorphic sum Σ_{k ∈ members} c_k of each planned
release (:func:`afl.crypto.ckks.sum_ciphertexts`) and hands it to the decryptor as a decryption
job. The decryptor's grid-rounded float64 result is what :meth:`CkksStrategy.release_sum`
returns to the solve; a refused job aborts the round (nothing else is released).

Plan encoding: every release's upload is ``DTYPE_CKKS_VECTORS`` with a ``CkksEncoding`` whose
pre-scale is ``choose_prescale(bound=B, num_summands=K)`` (K = members, B = ``[round]
ckks_gram_bound`` or ``ckks_vector_bound``: the declared bound on |entry| of one site's Gram or
class vector) and whose grid step is ``default_grid`` (:mod:`afl.crypto.ckks_params`).

State lives in memory except the published context (``<state_dir>/ckks/context.bin`` and its
signed announcement), which a restarted server re-loads and re-checks.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.aggregation import AggregationError
from afl.core.packing import packed_length, unpack_upper
from afl.crypto import ckks
from afl.crypto import ckks_params as cp
from afl.crypto.errors import CryptoError
from afl.proto.v1 import common_pb2
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.errors import ConfigError, InvalidRequestError, WrongStageError
from afl.server.plan import PlannedRelease
from afl.server.uploads import decode_float64

__all__ = ["CkksStrategy", "PublishedContext", "load_public_context_file", "wire_length"]

DEFAULT_GRAM_BOUND = 1.0e6
DEFAULT_VECTOR_BOUND = 1.0e3


def wire_length(release: PlannedRelease) -> int:
    """Number of float64 values of one site's upload (packed upper triangle for a Gram)."""
    if release.packed:
        return packed_length(release.shape[0])
    return int(np.prod(release.shape))


def load_public_context_file(path: Path) -> tuple[bytes, Any]:
    """Read a serialized CKKS context; :class:`ConfigError` (refuse to start) if it holds a
    secret key or does not have the vetted parameters."""
    data = path.read_bytes()
    try:
        ctx = ckks.load_public_context(data)
    except CryptoError as exc:
        raise ConfigError(
            f"{path}: refusing to start: the CKKS context is not an acceptable PUBLIC context "
            f"({exc}); the server must never hold the decryptor's secret key"
        ) from exc
    return data, ctx


@dataclass
class PublishedContext:
    """The decryptor's public context as published (bytes, parsed context, announcement)."""

    data: bytes
    ctx: Any
    announcement: pb.CkksContextAnnouncement


@dataclass
class _RoundState:
    tags: dict[str, pb.SealedMessage] = field(default_factory=dict)
    aggregates: dict[str, bytes] = field(default_factory=dict)
    staged_results: dict[str, bytes] = field(default_factory=dict)
    results: dict[str, NDArray[np.float64]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


class CkksStrategy:
    """Aggregation strategy of ``aggregation = "ckks"`` (see the module docstring)."""

    name = "ckks"
    proto_mode = int(common_pb2.AGGREGATION_MODE_CKKS)

    def __init__(
        self,
        *,
        gram_bound: float = DEFAULT_GRAM_BOUND,
        vector_bound: float = DEFAULT_VECTOR_BOUND,
        state_dir: Path | None = None,
        configured_context: Path | None = None,
    ) -> None:
        self.gram_bound, self.vector_bound = float(gram_bound), float(vector_bound)
        self._dir = None if state_dir is None else Path(state_dir) / "ckks"
        self._rounds: dict[str, _RoundState] = {}
        self._sum_lock = threading.Lock()
        self.published: PublishedContext | None = None
        self.configured: tuple[bytes, Any] | None = None
        if configured_context is not None:
            self.configured = load_public_context_file(configured_context)
        if self._dir is not None and (self._dir / "context.bin").is_file():
            data, ctx = load_public_context_file(self._dir / "context.bin")
            announcement = pb.CkksContextAnnouncement.FromString(
                (self._dir / "announcement.bin").read_bytes()
            )
            self.published = PublishedContext(data, ctx, announcement)

    # --- plan --------------------------------------------------------------------------------

    def encoding(self, members: int, *, gram: bool = True) -> common_pb2.CkksEncoding:
        """Pre-scale and grid of a release summed over ``members`` sites (module docstring)."""
        bound = self.gram_bound if gram else self.vector_bound
        prescale = cp.choose_prescale(bound=bound, num_summands=members)
        grid = cp.default_grid(prescale=prescale, num_summands=members)
        return common_pb2.CkksEncoding(prescale=prescale, grid_step=grid)

    def _release_encoding(self, release: PlannedRelease) -> common_pb2.Encoding:
        packing = common_pb2.PACKING_UPPER_TRIANGLE if release.packed else common_pb2.PACKING_DENSE
        return common_pb2.Encoding(
            dtype=common_pb2.DTYPE_CKKS_VECTORS,
            packing=packing,
            ckks=self.encoding(len(release.members), gram=release.packed),
        )

    def plan_options(self, participants: tuple[str, ...]) -> dict[str, Any]:
        """Hook of :class:`afl.server.rounds.RoundMachine`: ``build_plan`` arguments of a CKKS
        plan (aggregation mode and each release's ``CkksEncoding``)."""
        return {"aggregation": common_pb2.AGGREGATION_MODE_CKKS, "encoding": self._release_encoding}

    # --- context -----------------------------------------------------------------------------

    def publish(self, published: PublishedContext) -> None:
        """Record the decryptor's checked public context (persisted when a state dir is set)."""
        ckks.ensure_public(published.ctx)
        if self.configured is not None and self.configured[0] != published.data:
            raise InvalidRequestError("the published context differs from the configured one")
        if self.published is not None:
            if self.published.data != published.data:
                raise WrongStageError("a different CKKS context is already published")
            return
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            (self._dir / "context.bin").write_bytes(published.data)
            (self._dir / "announcement.bin").write_bytes(published.announcement.SerializeToString())
        self.published = published

    def context(self) -> PublishedContext:
        if self.published is None:
            raise WrongStageError("the decryptor has not published its CKKS context yet")
        return self.published

    # --- uploads and sums --------------------------------------------------------------------

    def round_state(self, round_id: str) -> _RoundState:
        return self._rounds.setdefault(round_id, _RoundState())

    def check_payload(self, release: PlannedRelease, data: bytes) -> None:
        ctx = self.context().ctx
        try:
            ckks.deserialize_ciphertexts(
                ctx, ckks.unpack_ciphertexts(data), length=wire_length(release)
            )
        except CryptoError as exc:
            raise InvalidRequestError(f"release {release.name!r}: {exc}") from exc

    def aggregate(
        self, round_id: str, release: PlannedRelease, payloads: Mapping[str, bytes]
    ) -> bytes:
        """Packed ciphertexts of Σ_k c_k over ``release.members`` (computed once per round)."""
        state = self.round_state(round_id)
        with self._sum_lock:
            if release.name not in state.aggregates:
                ctx, length = self.context().ctx, wire_length(release)
                uploads = [
                    ckks.deserialize_ciphertexts(
                        ctx, ckks.unpack_ciphertexts(payloads[s]), length=length
                    )
                    for s in release.members
                ]
                total = ckks.sum_ciphertexts(ctx, uploads, length=length)
                state.aggregates[release.name] = ckks.pack_ciphertexts(
                    ckks.serialize_ciphertexts(total)
                )
            return state.aggregates[release.name]

    def accept_result(
        self, round_id: str, release: PlannedRelease, *, status: int, data: bytes, reason: str
    ) -> None:
        """Record the decryptor's outcome for ``release`` (the caller verified its signature)."""
        state = self.round_state(round_id)
        if release.name in state.results or release.name in state.refused:
            raise WrongStageError(f"release {release.name!r} already has a decryption outcome")
        if status != pb.DECRYPTION_STATUS_DECRYPTED:
            state.refused[release.name] = f"{pb.DecryptionStatus.Name(status)}: {reason}"  # type: ignore[arg-type]
            return
        values = decode_float64(data, length=wire_length(release), what=release.name)
        state.results[release.name] = (
            unpack_upper(values) if release.packed else values.reshape(release.shape)
        )

    def pending(self, round_id: str, releases: tuple[PlannedRelease, ...]) -> list[str]:
        """Releases of the round without a decryption outcome yet."""
        state = self.round_state(round_id)
        return [
            r.name for r in releases if r.name not in state.results and r.name not in state.refused
        ]

    def drive(self, machine: Any, view: Any) -> bool:
        """Hook of the round machine: hold a SOLVING round until every release has an outcome
        from the decryptor (the decryptor polls ``GetDecryptionJobs`` meanwhile)."""
        return bool(
            view.row.stage == pb.ROUND_STAGE_SOLVING and self.pending(view.round_id, view.releases)
        )

    def decoded_sums(self, view: Any) -> dict[str, NDArray[np.float64]]:
        """Hook of the round machine: the decryptor's results for the round's releases."""
        state = self.round_state(view.round_id)
        out: dict[str, NDArray[np.float64]] = {}
        for release in view.releases:
            if release.name in state.refused:
                raise AggregationError(
                    f"the decryptor refused release {release.name!r}: {state.refused[release.name]}"
                )
            if release.name not in state.results:
                raise AggregationError(f"release {release.name!r} has not been decrypted")
            out[release.name] = state.results[release.name]
        return out

    def release_sum(
        self, release: PlannedRelease, payloads: Mapping[str, bytes]
    ) -> NDArray[np.float64]:
        """Not used (``decoded_sums`` answers for the round); sums need the decryptor."""
        raise AggregationError(f"release {release.name!r}: CKKS sums come from the decryptor")
