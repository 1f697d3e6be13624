"""The one hand-written mapping between the generated protobuf messages and the protocol, used by
the coordinator, the sites and the decryptor alike (docs/architecture.md §5).

* :data:`PROTOCOL_VERSION`: the wire protocol version a site and the server speak
  (``EnrollRequest.protocol_version``, ``RoundConfig.protocol_version``). Not to be confused with
  :data:`afl.crypto.canonical.DOMAIN_TAG`, the domain separator inside every signature and KDF.
* :func:`enrol_proof_fields`: the fields an ``EnrollRequest``'s proof signs, from the request
  itself, so the site signs and the server verifies the same tuple (docs/protocol.md §3).
* :func:`release_length`: number of wire elements of one site's contribution to a release
  (d(d+1)/2 for a Gram travelling as a packed upper triangle, prod(shape) otherwise).
* The evaluation releases (SCORE_HISTOGRAM, CONFUSION_COUNTS): :func:`evaluation_spec` writes and
  :func:`read_evaluation` checks a release's ``EvaluationSpec`` (model digest, score bins,
  threshold), :func:`evaluation_shape` gives its logical shape.
* Chunk framing of ``Upload`` and ``Download`` streams, both directions (:func:`iter_chunks`,
  :class:`ChunkAssembler`): every chunk repeats the header (round, release, kind, total chunks,
  total bytes), indices run 0..total-1 in order, and the last chunk carries the SHA-256 of the
  whole payload. At most :data:`MAX_CHUNK_BYTES` per chunk (gRPC's default receive limit is 4 MiB).
* The MASK-mode messages (coordinator.proto "MASK mode") both ways: site -> protobuf
  (``*_to_proto``) and protobuf -> :mod:`afl.crypto.secagg.messages` objects (``*_from_proto``).
  A message's sender is always the authenticated caller passed in by the receiver, never a field
  of the request. :func:`round_config_from_plan` derives the protocol config from the SIGNED
  release plan alone, so the config digest bound into every signature is the same everywhere.
* The CKKS aggregate tags' envelope: :func:`tag_binding` (what a site's signed tags are bound
  to, built the same way by the site, the coordinator and the decryptor) and
  :func:`sealed_tags_to_proto` / :func:`sealed_tags_from_proto`.

Errors are :class:`WireError` (malformed input) and :class:`WireLimitError` (over a size limit);
the server maps them to INVALID_ARGUMENT and RESOURCE_EXHAUSTED, the sites to a DaemonError.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from afl.core.dp.accounting import StatisticKind
from afl.core.evaluation.scorebins import ScoreBins, ScoreBinsError
from afl.core.packing import packed_length
from afl.crypto.canonical import Field
from afl.crypto.ckks.wire import SealedTags, TagBinding
from afl.crypto.errors import SecAggConfigError, ShamirError
from afl.crypto.identity.signed_blobs import enrol_fields
from afl.crypto.secagg.config import ReleaseSpec, RoundConfig, SparseGraph
from afl.crypto.secagg.messages import (
    KIND_MASK_KEY,
    KIND_SELF_MASK,
    AdvertiseKeys,
    ConsistencySignature,
    EncryptedShare,
    KeyDirectory,
    MaskedInputUpload,
    RevealedShare,
    RoutedShares,
    ShareKeysUpload,
    UnmaskRequest,
    UnmaskResponse,
)
from afl.crypto.shamir import VALUE_BYTES, Share
from afl.crypto.transparency.checkpoint import (
    Checkpoint,
    CheckpointError,
    Cosignature,
    SignedCheckpoint,
)
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = [
    "DP_STATISTIC_NAMES",
    "EVALUATION_KINDS",
    "MAX_CHUNK_BYTES",
    "PROTOCOL_VERSION",
    "REFUSAL_TRAILER",
    "TRY_LATER_TRAILER",
    "AssembledPayload",
    "ChunkAssembler",
    "EvaluationRelease",
    "WireError",
    "WireLimitError",
    "advert_from_proto",
    "advert_to_proto",
    "assemble",
    "checkpoint_from_proto",
    "checkpoint_to_proto",
    "consistency_from_proto",
    "cosignature_from_proto",
    "cosignature_to_proto",
    "directory_from_proto",
    "directory_to_proto",
    "enrol_proof_fields",
    "evaluation_shape",
    "evaluation_spec",
    "iter_chunks",
    "masked_upload",
    "opening_mode",
    "read_evaluation",
    "release_length",
    "release_statement_fields",
    "round_config_from_plan",
    "routed_from_proto",
    "routed_to_proto",
    "sealed_tags_from_proto",
    "sealed_tags_to_proto",
    "share_keys_from_proto",
    "share_keys_to_proto",
    "sparse_graph",
    "stage_name",
    "tag_binding",
    "unmask_request_from_proto",
    "unmask_request_to_proto",
    "unmask_response_from_proto",
    "unmask_response_to_proto",
]

#: Wire protocol version (EnrollRequest / RoundConfig ``protocol_version``): 2 since the
#: federation log and the decryption outcome's signature over the federation and the plan's
#: digest (CHANGELOG); a party that speaks another version is refused with both versions named.
PROTOCOL_VERSION = 2
#: Largest chunk of an Upload or Download stream.
MAX_CHUNK_BYTES = 1 << 20
#: Trailing-metadata key of a status that means "try later" (a full disk, a per-site stream
#: limit): the site retries it with back-off within its retry window (docs/protocol.md §3).
TRY_LATER_TRAILER = "afl-try-later"
#: Trailing-metadata key of every answer of a coordinator that refuses its state (UNAVAILABLE,
#: the details name the reason): the site stops at once with that reason instead of retrying.
REFUSAL_TRAILER = "afl-coordinator-refuses"

_SHARE_TYPES: dict[int, Literal["self-mask", "mask-key"]] = {
    pb.SHARE_TYPE_SELF_MASK_SEED: KIND_SELF_MASK,
    pb.SHARE_TYPE_MASK_KEY: KIND_MASK_KEY,
}


class WireError(ValueError):
    """A message or stream that does not follow the wire format (the text names the field)."""


class WireLimitError(WireError):
    """A chunk or a transfer above the receiver's size limits."""


def release_statement_fields(
    *,
    round_id: str,
    run_id: str,
    survivors: Iterable[str],
    releases: Iterable[tuple[str, int, Sequence[str], Sequence[str]]],
) -> dict[str, object]:
    """The fields of a federation-log `release` statement (docs/protocol.md §11a): the round,
    its run, the survivors its sums were unmasked or decrypted over, and each release as
    (name, StatisticKind, classes, members). The coordinator logs them; a site records a round
    it helped unmask in the same form."""
    return {
        "round_id": round_id,
        "run_id": run_id,
        "survivors": sorted(survivors),
        "releases": [
            {
                "name": name,
                "kind": cpb.StatisticKind.Name(cpb.StatisticKind.ValueType(kind)),
                "classes": list(classes),
                "members": list(members),
            }
            for name, kind, classes, members in releases
        ],
    }


def opening_mode(plan: cpb.ReleasePlan) -> str:
    """The ``mode`` field of an `opening` statement of ``plan``'s round (docs/protocol.md
    M-232): "mask" or "ckks" (:class:`WireError` for a mode whose sites sign no opening)."""
    modes = {cpb.AGGREGATION_MODE_MASK: "mask", cpb.AGGREGATION_MODE_CKKS: "ckks"}
    if plan.aggregation not in modes:
        raise WireError(f"round {plan.round_id!r} does not run mask or ckks: no opening is signed")
    return modes[plan.aggregation]


def stage_name(stage: int) -> str:
    """Name of a RoundStage value, e.g. "ROUND_STAGE_UPLOAD"."""
    return pb.RoundStage.Name(stage)  # type: ignore[arg-type]


def enrol_proof_fields(
    request: pb.EnrollRequest,
    *,
    federation_id: str,
    site_id: str,
    server_identity_public_key: bytes,
) -> list[Field]:
    """The fields of ``request``'s proof (:func:`afl.crypto.identity.signed_blobs.enrol_fields`): every
    field of the request but the proof, with the federation, the site (its certificate's) and
    the server identity key each side holds itself."""
    return enrol_fields(
        federation_id=federation_id,
        site_id=site_id,
        identity_public_key=bytes(request.identity_public_key),
        server_identity_public_key=server_identity_public_key,
        challenge=bytes(request.challenge),
        role=int(request.role),
        labelled_classes=list(request.labelled_classes),
        backbone=request.backbone,
        feature_dim=int(request.feature_dim),
        software_version=request.software_version,
        protocol_version=int(request.protocol_version),
        declared_rows=int(request.declared_rows),
        declared_max_row_norm=float(request.declared_max_row_norm),
        weights_sha256=request.weights_sha256,
        random_init=bool(request.random_init),
    )


def release_length(
    release: cpb.Release | None = None, *, shape: Sequence[int] = (), packed: bool = False
) -> int:
    """Wire elements of one site's contribution to a release: d(d+1)/2 for a Gram packed as an
    upper triangle, prod(shape) otherwise. Pass a ``cpb.Release`` or its ``shape``/``packed``."""
    if release is not None:
        shape = tuple(int(n) for n in release.shape)
        packed = release.encoding.packing == cpb.PACKING_UPPER_TRIANGLE
    if packed:
        return packed_length(int(shape[0]))
    return int(np.prod([int(n) for n in shape], dtype=np.int64))


#: The DP rulebook's name (:data:`afl.core.dp.accounting.StatisticKind`) of each statistic kind
#: a DP plan releases; the wire enum is the plan's, the name the rulebook's.
DP_STATISTIC_NAMES: Mapping[int, StatisticKind] = {
    cpb.STATISTIC_KIND_GRAM: "gram",
    cpb.STATISTIC_KIND_POSITIVE_SUM: "s_pos",
    cpb.STATISTIC_KIND_FEATURE_SUM: "t_sum",
    cpb.STATISTIC_KIND_COUNT: "counts",
    cpb.STATISTIC_KIND_PSEUDO_POSITIVE_SUM: "pseudo_s_pos",
    cpb.STATISTIC_KIND_PSEUDO_FEATURE_SUM: "pseudo_t_sum",
    cpb.STATISTIC_KIND_PSEUDO_COUNT: "pseudo_counts",
}


# --- evaluation releases ----------------------------------------------------------------------

#: Statistic kinds that evaluate a published model (they carry ``Release.evaluation``).
EVALUATION_KINDS = (cpb.STATISTIC_KIND_SCORE_HISTOGRAM, cpb.STATISTIC_KIND_CONFUSION_COUNTS)


@dataclass(frozen=True)
class EvaluationRelease:
    """The checked ``EvaluationSpec`` of an evaluation release."""

    kind: int
    classes: tuple[str, ...]
    model_sha256: str  # hex
    bins: ScoreBins
    threshold: float


def evaluation_shape(kind: int, *, classes: int, bins: ScoreBins) -> list[int]:
    """Logical shape: [C_r, 2, bins] for a histogram, [C_r, 4] for confusion counts."""
    if kind == cpb.STATISTIC_KIND_SCORE_HISTOGRAM:
        return [classes, 2, bins.num_bins]
    if kind == cpb.STATISTIC_KIND_CONFUSION_COUNTS:
        return [classes, 4]
    raise WireError(f"statistic kind {kind} is not an evaluation kind")


def evaluation_spec(
    *, model_sha256: bytes, bins: ScoreBins, threshold: float = 0.5
) -> cpb.EvaluationSpec:
    """The ``Release.evaluation`` of an evaluation release."""
    return cpb.EvaluationSpec(
        model_sha256=model_sha256, score_bin_edges=list(bins.edges), decision_threshold=threshold
    )


def read_evaluation(release: cpb.Release) -> EvaluationRelease:
    """Check an evaluation release's spec and shape; :class:`WireError` names what is wrong."""
    if release.kind not in EVALUATION_KINDS:
        raise WireError(f"release {release.name!r} is not an evaluation release")
    spec = release.evaluation
    if len(spec.model_sha256) != 32:
        raise WireError(f"release {release.name!r}: model_sha256 must be 32 bytes")
    try:
        bins = ScoreBins.from_edges(list(spec.score_bin_edges))
    except ScoreBinsError as exc:
        raise WireError(f"release {release.name!r}: {exc}") from exc
    if not 0.0 < spec.decision_threshold < 1.0:
        raise WireError(f"release {release.name!r}: decision threshold must lie in (0, 1)")
    classes = tuple(release.class_names)
    if not classes or len(set(classes)) != len(classes):
        raise WireError(f"release {release.name!r}: needs distinct class names")
    want = evaluation_shape(release.kind, classes=len(classes), bins=bins)
    if [int(n) for n in release.shape] != want:
        raise WireError(f"release {release.name!r}: shape {list(release.shape)}, want {want}")
    return EvaluationRelease(
        release.kind, classes, spec.model_sha256.hex(), bins, float(spec.decision_threshold)
    )


# --- chunk framing --------------------------------------------------------------------------


@dataclass(frozen=True)
class AssembledPayload:
    """A complete, digest-checked payload of one Upload or Download stream."""

    round_id: str
    release_name: str
    kind: int
    data: bytes
    sha256: bytes


def iter_chunks(
    data: bytes,
    *,
    round_id: str,
    release_name: str,
    kind: int = pb.PAYLOAD_KIND_STATISTIC,
    chunk_bytes: int = MAX_CHUNK_BYTES,
) -> Iterator[pb.UploadChunk]:
    """The chunks of one payload (module docstring); one empty chunk for an empty payload."""
    if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    digest = hashlib.sha256(data).digest()
    total = max(1, -(-len(data) // chunk_bytes))
    for index in range(total):
        yield pb.UploadChunk(
            round_id=round_id,
            release_name=release_name,
            chunk_index=index,
            total_chunks=total,
            data=data[index * chunk_bytes : (index + 1) * chunk_bytes],
            sha256=digest if index == total - 1 else b"",
            kind=kind,  # type: ignore[arg-type]
            total_bytes=len(data),
        )


def chunk_count(size: int, *, chunk_bytes: int = MAX_CHUNK_BYTES) -> int:
    """Number of chunks :func:`iter_chunks` cuts ``size`` bytes into."""
    return max(1, -(-size // chunk_bytes))


class ChunkAssembler:
    """Feed chunks with :meth:`add`, then :meth:`finish`. A stream is accepted only if every
    chunk repeats the first one's header, indices run 0..total-1 in order (a duplicated, skipped
    or reordered chunk is refused), no chunk exceeds ``max_chunk_bytes``, the declared total is
    at most ``max_bytes`` (checked on the FIRST chunk, before buffering), the bytes received equal
    the declared total and SHA-256 of the concatenation equals the digest on the last chunk."""

    def __init__(
        self, *, max_chunk_bytes: int = MAX_CHUNK_BYTES, max_bytes: int, require_names: bool = True
    ) -> None:
        self._max_chunk, self._max_bytes = max_chunk_bytes, max_bytes
        self._require_names = require_names
        self._header: tuple[str, str, int, int, int] | None = None
        self._parts: list[bytes] = []
        self._received = 0
        self._digest = b""

    def add(self, chunk: pb.UploadChunk) -> None:
        header = (
            chunk.round_id,
            chunk.release_name,
            int(chunk.kind),
            chunk.total_chunks,
            chunk.total_bytes,
        )
        if self._header is None:
            if self._require_names and (not chunk.round_id or not chunk.release_name):
                raise WireError("upload chunks must name the round and the release")
            if chunk.total_chunks < 1:
                raise WireError("total_chunks must be at least 1")
            if chunk.total_bytes > self._max_bytes:
                raise WireLimitError(
                    f"declared transfer of {chunk.total_bytes} bytes exceeds the limit of "
                    f"{self._max_bytes} bytes"
                )
            self._header = header
        elif header != self._header:
            raise WireError("chunk header fields changed within one transfer")
        if len(chunk.data) > self._max_chunk:
            raise WireLimitError(
                f"chunk of {len(chunk.data)} bytes exceeds the limit of {self._max_chunk} bytes"
            )
        expected = len(self._parts)
        if chunk.chunk_index != expected:
            raise WireError(
                f"chunk index {chunk.chunk_index} where {expected} was expected (chunks must "
                "arrive once each, in order)"
            )
        if expected >= chunk.total_chunks:
            raise WireError("more chunks than total_chunks")
        self._received += len(chunk.data)
        if self._received > chunk.total_bytes:
            raise WireError("chunks carry more bytes than total_bytes declares")
        self._parts.append(chunk.data)
        if expected == chunk.total_chunks - 1:
            self._digest = chunk.sha256

    def finish(self) -> AssembledPayload:
        if self._header is None:
            raise WireError("empty transfer: no chunks received")
        round_id, release_name, kind, total_chunks, total_bytes = self._header
        if len(self._parts) != total_chunks:
            raise WireError(f"truncated transfer: {len(self._parts)} of {total_chunks} chunks")
        if self._received != total_bytes:
            raise WireError(
                f"transfer has {self._received} bytes, total_bytes declares {total_bytes}"
            )
        if len(self._digest) != 32:
            raise WireError("the last chunk must carry the 32-byte SHA-256 digest")
        data = b"".join(self._parts)
        digest = hashlib.sha256(data).digest()
        if not hmac.compare_digest(digest, self._digest):
            raise WireError("SHA-256 of the received payload does not match its digest")
        return AssembledPayload(round_id, release_name, kind, data, digest)


def assemble(
    chunks: Iterable[pb.UploadChunk],
    *,
    max_bytes: int,
    max_chunk_bytes: int = MAX_CHUNK_BYTES,
    require_names: bool = True,
) -> AssembledPayload:
    """Consume a chunk stream into one checked payload (:class:`ChunkAssembler`)."""
    assembler = ChunkAssembler(
        max_chunk_bytes=max_chunk_bytes, max_bytes=max_bytes, require_names=require_names
    )
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


# --- MASK mode --------------------------------------------------------------------------------


def round_config_from_plan(plan: cpb.ReleasePlan, *, plan_sha256: bytes) -> RoundConfig:
    """The protocol config of a MASK plan: round id and salt, cohort, t, the sparse graph (k, t_N,
    C; absent = the full graph), per release its members, length and fixed-point encoding
    (bound B, f, t_R) exactly as signed, and as its context ``plan_sha256``, the SHA-256 of the
    signed plan bytes (which bind the roster digest; every advert and consistency signature of
    the round binds it, docs/protocol.md §4.2). ``b""`` only to check a plan's parameters, never
    for an exchange. Raises :class:`afl.crypto.errors.SecAggConfigError` when the plan is not a
    valid MASK config or the digest is neither 32 bytes nor empty."""
    if len(plan_sha256) not in (0, 32):
        raise SecAggConfigError(f"the plan digest has {len(plan_sha256)} bytes, not 32")
    releases = tuple(
        ReleaseSpec(
            name=r.name,
            members=tuple(r.member_site_ids),
            length=release_length(r),
            bound=r.encoding.fixed_point.bound,
            threshold=r.encoding.fixed_point.min_survivors or None,
            frac_bits=r.encoding.fixed_point.frac_bits,
        )
        for r in plan.releases
    )
    return RoundConfig(
        round_id=plan.round_id,
        round_salt=bytes(plan.round_salt),
        cohort=tuple(plan.participants),
        releases=releases,
        threshold=plan.mask_threshold or None,
        graph=sparse_graph(plan),
        context=bytes(plan_sha256),
    )


def sparse_graph(plan: cpb.ReleasePlan) -> SparseGraph | None:
    """The plan's sparse masking graph, None for the full graph (degree 0)."""
    graph = plan.mask_graph
    if not graph.degree:
        return None
    return SparseGraph(
        degree=int(graph.degree),
        share_threshold=int(graph.share_threshold),
        colluders=int(graph.colluders),
    )


def advert_to_proto(advert: AdvertiseKeys) -> pb.AdvertiseKeysRequest:
    return pb.AdvertiseKeysRequest(
        round_id=advert.round_id,
        cipher_public_key=advert.enc_public,
        mask_public_key=advert.mask_public,
        signature=advert.signature,
        graph_nonce=advert.graph_nonce,
        commitments_digest=advert.commitments_digest,
    )


def advert_from_proto(sender: str, request: pb.AdvertiseKeysRequest) -> AdvertiseKeys:
    return AdvertiseKeys(
        request.round_id,
        sender,
        bytes(request.cipher_public_key),
        bytes(request.mask_public_key),
        bytes(request.signature),
        bytes(request.commitments_digest),
        bytes(request.graph_nonce),
    )


def directory_to_proto(directory: KeyDirectory) -> pb.AdvertisedKeys:
    return pb.AdvertisedKeys(
        round_id=directory.round_id,
        keys=[
            pb.SiteKeys(
                site_id=a.site_id,
                cipher_public_key=a.enc_public,
                mask_public_key=a.mask_public,
                signature=a.signature,
                graph_nonce=a.graph_nonce,
                commitments_digest=a.commitments_digest,
            )
            for a in sorted(directory.adverts, key=lambda a: a.site_id)
        ],
    )


def directory_from_proto(keys: pb.AdvertisedKeys) -> KeyDirectory:
    adverts = tuple(
        AdvertiseKeys(
            keys.round_id,
            k.site_id,
            bytes(k.cipher_public_key),
            bytes(k.mask_public_key),
            bytes(k.signature),
            bytes(k.commitments_digest),
            bytes(k.graph_nonce),
        )
        for k in keys.keys
    )
    return KeyDirectory(keys.round_id, adverts)


def _sealed(shares: Iterable[EncryptedShare]) -> list[pb.SealedMessage]:
    return [
        pb.SealedMessage(
            sender_site_id=s.sender, recipient_site_id=s.recipient, ciphertext=s.ciphertext
        )
        for s in shares
    ]


def share_keys_to_proto(upload: ShareKeysUpload) -> pb.ShareKeysRequest:
    return pb.ShareKeysRequest(round_id=upload.round_id, shares=_sealed(upload.shares))


def share_keys_from_proto(sender: str, request: pb.ShareKeysRequest) -> ShareKeysUpload:
    """The sender of every sealed bundle is the caller (the envelope's sender field is ignored)."""
    shares = tuple(
        EncryptedShare(sender, m.recipient_site_id, bytes(m.ciphertext)) for m in request.shares
    )
    return ShareKeysUpload(request.round_id, sender, shares)


def routed_to_proto(routed: RoutedShares) -> pb.SharedKeys:
    return pb.SharedKeys(round_id=routed.round_id, shares=_sealed(routed.shares))


def routed_from_proto(shared: pb.SharedKeys, *, recipient: str) -> RoutedShares:
    shares = tuple(
        EncryptedShare(m.sender_site_id, m.recipient_site_id, bytes(m.ciphertext))
        for m in shared.shares
    )
    return RoutedShares(shared.round_id, recipient, shares)


def masked_upload(
    sender: str, round_id: str, payloads: Mapping[str, bytes], lengths: Mapping[str, int]
) -> MaskedInputUpload:
    """A site's masked payloads (uint64 little-endian, one per release) as one protocol upload."""
    vectors = []
    for name in sorted(payloads):
        data = payloads[name]
        if len(data) != 8 * lengths[name]:
            raise WireError(
                f"masked release {name!r} must be {lengths[name]} uint64 "
                f"({8 * lengths[name]} bytes), got {len(data)} bytes"
            )
        # A read-only view of the payload (no copy on little-endian machines).
        vectors.append((name, np.frombuffer(data, dtype="<u8").astype(np.uint64, copy=False)))
    return MaskedInputUpload(round_id, sender, tuple(vectors))


def consistency_from_proto(
    sender: str, request: pb.ConsistencySignature, *, survivors: tuple[str, ...]
) -> ConsistencySignature:
    if tuple(request.survivors) != survivors:
        raise WireError("the signed survivor list differs from GetSurvivors")
    return ConsistencySignature(request.round_id, sender, bytes(request.signature))


def unmask_request_to_proto(request: UnmaskRequest) -> pb.UnmaskRequest:
    return pb.UnmaskRequest(
        round_id=request.round_id,
        survivors=list(request.survivors),
        dropped=list(request.dropped),
        releases=list(request.releases),
        signatures=[
            pb.SiteSignature(site_id=s.site_id, signature=s.signature) for s in request.signatures
        ],
    )


def unmask_request_from_proto(request: pb.UnmaskRequest) -> UnmaskRequest:
    return UnmaskRequest(
        request.round_id,
        tuple(request.survivors),
        tuple(request.dropped),
        tuple(request.releases),
        tuple(
            ConsistencySignature(request.round_id, s.site_id, bytes(s.signature))
            for s in request.signatures
        ),
    )


def unmask_response_to_proto(response: UnmaskResponse) -> pb.UnmaskResponse:
    return pb.UnmaskResponse(
        round_id=response.round_id,
        shares=[
            pb.RevealedShare(
                owner_site_id=s.owner,
                type=(
                    pb.SHARE_TYPE_SELF_MASK_SEED
                    if s.kind == KIND_SELF_MASK
                    else pb.SHARE_TYPE_MASK_KEY
                ),
                share=cpb.ShamirShare(
                    x=s.share.index, y=s.share.value.to_bytes(VALUE_BYTES, "big")
                ),
                release_name=s.release,
            )
            for s in response.shares
        ],
    )


def unmask_response_from_proto(sender: str, request: pb.UnmaskResponse) -> UnmaskResponse:
    shares = []
    for item in request.shares:
        kind = _SHARE_TYPES.get(item.type)
        if kind is None or len(item.share.y) != VALUE_BYTES:
            raise WireError("a revealed share has an unknown type or a malformed value")
        try:
            share = Share(index=int(item.share.x), value=int.from_bytes(item.share.y, "big"))
        except ShamirError as exc:
            raise WireError(f"a revealed share is malformed: {exc}") from exc
        release = item.release_name if kind == KIND_SELF_MASK else ""
        shares.append(RevealedShare(item.owner_site_id, kind, release, share))
    return UnmaskResponse(request.round_id, sender, tuple(shares))


# --- CKKS mode --------------------------------------------------------------------------------


def tag_binding(
    plan: cpb.ReleasePlan,
    *,
    plan_sha256: bytes,
    sender: str,
    decryptor: str,
    decryptor_key: bytes,
) -> TagBinding:
    """What ``sender``'s aggregate tags in the round of ``plan`` are bound to: the plan's
    federation, round and salt, ``plan_sha256`` (SHA-256 of the signed plan bytes), the decryptor
    and its X25519 tag key (:class:`afl.crypto.ckks.wire.TagBinding`)."""
    if len(plan_sha256) != 32:
        raise WireError("the plan digest must be 32 bytes to bind CKKS tags")
    return TagBinding(
        federation_id=plan.federation_id,
        round_id=plan.round_id,
        round_salt=bytes(plan.round_salt),
        plan_sha256=bytes(plan_sha256),
        sender=sender,
        recipient=decryptor,
        recipient_key=bytes(decryptor_key),
    )


def sealed_tags_to_proto(sealed: SealedTags, *, decryptor: str) -> pb.SealedMessage:
    return pb.SealedMessage(
        recipient_site_id=decryptor,
        sender_public_key=sealed.ephemeral_public_key,
        ciphertext=sealed.blob,
        signature=sealed.signature,
    )


def sealed_tags_from_proto(message: pb.SealedMessage) -> SealedTags:
    return SealedTags(
        bytes(message.sender_public_key), bytes(message.ciphertext), bytes(message.signature)
    )


# --- the federation log (docs/protocol.md §11a) ------------------------------------------------


def checkpoint_to_proto(signed: SignedCheckpoint) -> pb.LogCheckpoint:
    c = signed.checkpoint
    return pb.LogCheckpoint(
        federation_id=c.federation, size=c.size, root=c.root, signature=signed.signature
    )


def checkpoint_from_proto(message: pb.LogCheckpoint) -> SignedCheckpoint:
    """:class:`WireError` for a malformed checkpoint (its signature is checked by the caller)."""
    try:
        checkpoint = Checkpoint(message.federation_id, int(message.size), bytes(message.root))
    except CheckpointError as exc:
        raise WireError(f"log checkpoint: {exc}") from exc
    return SignedCheckpoint(checkpoint, bytes(message.signature))


def cosignature_to_proto(cosignature: Cosignature) -> pb.LogCosignature:
    c = cosignature.checkpoint
    return pb.LogCosignature(
        witness=cosignature.witness, size=c.size, root=c.root, signature=cosignature.signature
    )


def cosignature_from_proto(message: pb.LogCosignature, *, federation: str) -> Cosignature:
    """:class:`WireError` for a malformed cosignature (its signature is checked by the caller)."""
    try:
        checkpoint = Checkpoint(federation, int(message.size), bytes(message.root))
    except CheckpointError as exc:
        raise WireError(f"log cosignature: {exc}") from exc
    return Cosignature(message.witness, checkpoint, bytes(message.signature))
