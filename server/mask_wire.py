"""Wire mapping of the secure-aggregation messages on the server side (design §6; coordinator.proto
"MASK mode"): protobuf requests of a site -> :mod:`afl.crypto.secagg_messages` objects, and the
server's stage outputs -> protobuf replies.

The sender of every client message is the authenticated site id (from its mTLS certificate),
never a request field. The round's :class:`~afl.crypto.secagg_config.RoundConfig` is derived from
the signed release plan only (:func:`round_config_from_plan`), so the config digest bound into
every signature is the same at the server and at each site.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np

from afl.core.packing import packed_length
from afl.crypto.errors import ShamirError
from afl.crypto.secagg_config import ReleaseSpec, RoundConfig
from afl.crypto.secagg_messages import (
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
from afl.crypto.shamir import Share
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.errors import InvalidRequestError

__all__ = [
    "SHARE_VALUE_BYTES",
    "advert_from_proto",
    "consistency_from_proto",
    "directory_to_proto",
    "masked_upload",
    "release_length",
    "round_config_from_plan",
    "routed_to_proto",
    "share_keys_from_proto",
    "unmask_request_to_proto",
    "unmask_response_from_proto",
]

#: Bytes of a Shamir share value y on the wire (ShamirShare.y, GF(2^521 - 1)).
SHARE_VALUE_BYTES = 66
_KIND_OF: dict[int, Literal["self-mask", "mask-key"]] = {
    pb.SHARE_TYPE_SELF_MASK_SEED: KIND_SELF_MASK,
    pb.SHARE_TYPE_MASK_KEY: KIND_MASK_KEY,
}


def release_length(release: cpb.Release) -> int:
    """Elements of a release's flat vector: d(d+1)/2 for a packed Gram, prod(shape) otherwise."""
    if release.encoding.packing == cpb.PACKING_UPPER_TRIANGLE:
        return packed_length(int(release.shape[0]))
    return int(np.prod(list(release.shape)))


def round_config_from_plan(plan: cpb.ReleasePlan) -> RoundConfig:
    """The protocol config of a MASK plan: round id and salt, cohort, t and, per release, its
    members, length and fixed-point encoding (bound B, f, t_R) exactly as signed."""
    releases = []
    for r in plan.releases:
        fp = r.encoding.fixed_point
        releases.append(
            ReleaseSpec(
                name=r.name,
                members=tuple(r.member_site_ids),
                length=release_length(r),
                bound=fp.bound,
                threshold=fp.min_survivors or None,
                frac_bits=fp.frac_bits,
            )
        )
    return RoundConfig(
        round_id=plan.round_id,
        round_salt=bytes(plan.round_salt),
        cohort=tuple(plan.participants),
        releases=tuple(releases),
        threshold=plan.mask_threshold or None,
    )


def advert_from_proto(site: str, request: pb.AdvertiseKeysRequest) -> AdvertiseKeys:
    return AdvertiseKeys(
        request.round_id,
        site,
        bytes(request.cipher_public_key),
        bytes(request.mask_public_key),
        bytes(request.signature),
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
            )
            for a in sorted(directory.adverts, key=lambda a: a.site_id)
        ],
    )


def share_keys_from_proto(site: str, request: pb.ShareKeysRequest) -> ShareKeysUpload:
    """The sender of every sealed bundle is the caller (the envelope's sender field is ignored)."""
    shares = tuple(
        EncryptedShare(site, m.recipient_site_id, bytes(m.ciphertext)) for m in request.shares
    )
    return ShareKeysUpload(request.round_id, site, shares)


def routed_to_proto(routed: RoutedShares) -> pb.SharedKeys:
    return pb.SharedKeys(
        round_id=routed.round_id,
        shares=[
            pb.SealedMessage(
                sender_site_id=s.sender, recipient_site_id=s.recipient, ciphertext=s.ciphertext
            )
            for s in routed.shares
        ],
    )


def masked_upload(
    site: str, round_id: str, payloads: Mapping[str, bytes], lengths: Mapping[str, int]
) -> MaskedInputUpload:
    """A site's stored masked payloads (uint64 little-endian, one per release) as one upload."""
    vectors = []
    for name in sorted(payloads):
        data = payloads[name]
        if len(data) != 8 * lengths[name]:
            raise InvalidRequestError(f"masked release {name!r} must hold {lengths[name]} uint64")
        vectors.append((name, np.frombuffer(data, dtype="<u8").astype(np.uint64)))
    return MaskedInputUpload(round_id, site, tuple(vectors))


def consistency_from_proto(
    site: str, request: pb.ConsistencySignature, *, survivors: tuple[str, ...]
) -> ConsistencySignature:
    if tuple(request.survivors) != survivors:
        raise InvalidRequestError("the signed survivor list differs from GetSurvivors")
    return ConsistencySignature(request.round_id, site, bytes(request.signature))


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


def unmask_response_from_proto(site: str, request: pb.UnmaskResponse) -> UnmaskResponse:
    shares = []
    for item in request.shares:
        kind = _KIND_OF.get(item.type)
        if kind is None or len(item.share.y) != SHARE_VALUE_BYTES:
            raise InvalidRequestError("a revealed share has an unknown type or a malformed value")
        try:
            share = Share(index=int(item.share.x), value=int.from_bytes(item.share.y, "big"))
        except ShamirError as exc:
            raise InvalidRequestError(f"a revealed share is malformed: {exc}") from exc
        release = item.release_name if kind == KIND_SELF_MASK else ""
        shares.append(RevealedShare(item.owner_site_id, kind, release, share))
    return UnmaskResponse(request.round_id, site, tuple(shares))
