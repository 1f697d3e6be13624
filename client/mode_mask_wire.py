"""Wire mapping of the secure-aggregation messages on the site side (design §6; coordinator.proto
"MASK mode"): :mod:`afl.crypto.secagg_messages` objects -> protobuf requests, and the server's
replies -> protocol objects that :class:`afl.crypto.secagg_client.SecAggClient` then checks.

:func:`round_config_from_plan` derives the protocol config from the SIGNED plan only (the same
derivation as the server's :mod:`afl.server.mask_wire`; the config digest is bound into every
signature, so a server that deviates is caught at the first signature check).
"""

from __future__ import annotations

import numpy as np

from afl.core.packing import packed_length
from afl.crypto.secagg_config import ReleaseSpec, RoundConfig
from afl.crypto.secagg_messages import (
    KIND_SELF_MASK,
    AdvertiseKeys,
    ConsistencySignature,
    EncryptedShare,
    KeyDirectory,
    RoutedShares,
    ShareKeysUpload,
    UnmaskRequest,
    UnmaskResponse,
)
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = [
    "advert_to_proto",
    "directory_from_proto",
    "round_config_from_plan",
    "routed_from_proto",
    "share_keys_to_proto",
    "unmask_request_from_proto",
    "unmask_response_to_proto",
]

_VALUE_BYTES = 66


def _length(release: cpb.Release) -> int:
    if release.encoding.packing == cpb.PACKING_UPPER_TRIANGLE:
        return packed_length(int(release.shape[0]))
    return int(np.prod(list(release.shape)))


def round_config_from_plan(plan: cpb.ReleasePlan) -> RoundConfig:
    """The protocol config of a signed MASK plan (raises SecAggConfigError when invalid, e.g.
    K·B·2^f >= 2^63 or a release below the minimum cohort without an explicit t_R)."""
    releases = tuple(
        ReleaseSpec(
            name=r.name,
            members=tuple(r.member_site_ids),
            length=_length(r),
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
    )


def advert_to_proto(advert: AdvertiseKeys) -> pb.AdvertiseKeysRequest:
    return pb.AdvertiseKeysRequest(
        round_id=advert.round_id,
        cipher_public_key=advert.enc_public,
        mask_public_key=advert.mask_public,
        signature=advert.signature,
    )


def directory_from_proto(keys: pb.AdvertisedKeys) -> KeyDirectory:
    adverts = tuple(
        AdvertiseKeys(
            keys.round_id,
            k.site_id,
            bytes(k.cipher_public_key),
            bytes(k.mask_public_key),
            bytes(k.signature),
        )
        for k in keys.keys
    )
    return KeyDirectory(keys.round_id, adverts)


def share_keys_to_proto(upload: ShareKeysUpload) -> pb.ShareKeysRequest:
    return pb.ShareKeysRequest(
        round_id=upload.round_id,
        shares=[
            pb.SealedMessage(
                sender_site_id=s.sender, recipient_site_id=s.recipient, ciphertext=s.ciphertext
            )
            for s in upload.shares
        ],
    )


def routed_from_proto(shared: pb.SharedKeys, *, recipient: str) -> RoutedShares:
    shares = tuple(
        EncryptedShare(m.sender_site_id, m.recipient_site_id, bytes(m.ciphertext))
        for m in shared.shares
    )
    return RoutedShares(shared.round_id, recipient, shares)


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
                    x=s.share.index, y=s.share.value.to_bytes(_VALUE_BYTES, "big")
                ),
                release_name=s.release,
            )
            for s in response.shares
        ],
    )
