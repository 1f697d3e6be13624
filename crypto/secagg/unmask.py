"""Server-side reconstruction of secure aggregation's Unmask stage (docs/protocol.md §4.2).

From the Unmask responses of U5 (≥ t clients) the server recovers, by Shamir interpolation of
t shares (:func:`afl.crypto.shamir.reconstruct_many`: one set of Lagrange weights for all
secrets when the same t holders answer),

    s_sk_d   for every dropped site d ∈ U2 \\ U3 (checked against d's advertised s_pk), and
    b_{i,R}  for every survivor i ∈ U3 and every released release R ∋ i,

and then computes, for a released R with live set L_R = M_R ∩ U2 and survivors S_R = M_R ∩ U3
(the server keeps the running sum Σ_{i∈S_R} y_{i,R}, not each upload),

    Σ_{i∈S_R} x_{i,R} = Σ_{i∈S_R} y_{i,R} - Σ_{i∈S_R} PRG(b_{i,R}; R)
                        - Σ_{d ∈ L_R \\ S_R} correction_d   (mod 2^64)

(:func:`afl.crypto.masking.unmask_sum`), decoded by the release's fixed-point codec.

With a sparse graph (``neighbours``: N(u) for every site) a secret is held by its owner's
neighbours and the owner only, shared t_N-of-(k + 1) (``config.share_threshold``), so a responder
reveals exactly the shares of the owners it holds, and a dropped site's correction covers its
surviving neighbours.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from numpy.typing import NDArray

from afl.crypto.errors import CryptoError, ProtocolError
from afl.crypto.kdf import (
    agree,
    derive_pairwise_mask_seed,
    load_agreement_private_key,
    public_key_bytes,
)
from afl.crypto.masking import unmask_total
from afl.crypto.secagg.config import ReleaseSpec, RoundConfig
from afl.crypto.secagg.messages import KIND_MASK_KEY, KIND_SELF_MASK, UnmaskResponse
from afl.crypto.shamir import Share, reconstruct_many

__all__ = [
    "SecretId",
    "collect_shares",
    "expected_reveals",
    "reconstruct_mask_keys",
    "reconstruct_self_seeds",
    "release_sum",
]

#: (kind, owner, release) naming one shared secret; release is "" for mask keys.
SecretId = tuple[str, str, str]


def expected_reveals(
    config: RoundConfig,
    *,
    survivors: Sequence[str],
    dropped: Sequence[str],
    releases: Sequence[str],
    responder: str = "",
    neighbours: Mapping[str, Collection[str]] | None = None,
) -> frozenset[SecretId]:
    """The exact set of secrets an Unmask response of ``responder`` must carry one share of
    (with a sparse graph only those of the owners it holds shares of: itself and N(responder))."""

    def held(owner: str) -> bool:
        return neighbours is None or owner == responder or responder in neighbours[owner]

    wanted: set[SecretId] = {(KIND_MASK_KEY, d, "") for d in dropped if held(d)}
    for name in releases:
        members = set(config.release(name).members)
        wanted |= {(KIND_SELF_MASK, v, name) for v in survivors if v in members and held(v)}
    return frozenset(wanted)


def collect_shares(
    config: RoundConfig, responses: Mapping[str, UnmaskResponse]
) -> dict[SecretId, list[Share]]:
    """Group revealed shares by secret, checking each share's index is its holder's index."""
    grouped: dict[SecretId, list[Share]] = {}
    for holder in sorted(responses):
        index = config.share_index(holder)
        for item in responses[holder].shares:
            if item.share.index != index:
                raise ProtocolError(f"share from {holder!r} has index {item.share.index}")
            grouped.setdefault((item.kind, item.owner, item.release), []).append(item.share)
    return grouped


def _reconstruct(
    shares: Mapping[SecretId, list[Share]], keys: Sequence[SecretId], t: int
) -> dict[SecretId, bytes]:
    for key in keys:
        if len(shares.get(key, [])) < t:
            got = len(shares.get(key, []))
            raise ProtocolError(f"only {got} shares of the {key[0]} of {key[1]!r}; need t={t}")
    try:
        values = reconstruct_many([shares[key] for key in keys], threshold=t)
    except CryptoError as exc:
        raise ProtocolError(f"cannot reconstruct the unmasking secrets: {exc}") from exc
    return dict(zip(keys, values, strict=True))


def reconstruct_mask_keys(
    config: RoundConfig,
    shares: Mapping[SecretId, list[Share]],
    *,
    dropped: Sequence[str],
    mask_publics: Mapping[str, bytes],
) -> dict[str, X25519PrivateKey]:
    """s_sk_d for each dropped d; :class:`ProtocolError` if it does not match d's advertised s_pk."""
    keys: dict[str, X25519PrivateKey] = {}
    raw = _reconstruct(shares, [(KIND_MASK_KEY, d, "") for d in dropped], config.share_threshold)
    for d in dropped:
        key = load_agreement_private_key(raw[(KIND_MASK_KEY, d, "")])
        if public_key_bytes(key) != mask_publics[d]:
            raise ProtocolError(f"reconstructed mask key of {d!r} does not match its advert")
        keys[d] = key
    return keys


def reconstruct_self_seeds(
    config: RoundConfig,
    shares: Mapping[SecretId, list[Share]],
    *,
    survivors: Sequence[str],
    release: ReleaseSpec,
) -> dict[str, bytes]:
    """b_{i,R} for every survivor i that is a member of release R."""
    owners = [i for i in survivors if i in release.members]
    keys = [(KIND_SELF_MASK, i, release.name) for i in owners]
    raw = _reconstruct(shares, keys, config.share_threshold)
    return {i: raw[(KIND_SELF_MASK, i, release.name)] for i in owners}


def release_sum(
    config: RoundConfig,
    *,
    release: ReleaseSpec,
    masked_total: NDArray[np.uint64],
    survivors: Sequence[str],
    live: Sequence[str],
    self_seeds: Mapping[str, bytes],
    mask_keys: Mapping[str, X25519PrivateKey],
    mask_publics: Mapping[str, bytes],
    neighbours: Mapping[str, Collection[str]] | None = None,
) -> NDArray[np.float64]:
    """Decoded Σ_{i∈S_R} x_{i,R} (module docstring); ``masked_total`` is Σ_{i∈S_R} y_{i,R} over
    the ``survivors`` S_R, and ``live`` is U2 (members of R outside U2 never entered anyone's
    masks)."""
    members = [m for m in release.members if m in set(live)]
    uploaded = set(survivors)
    survivors = [m for m in members if m in uploaded]
    dropped_seeds: dict[str, dict[str, bytes]] = {}
    for d in members:
        if d in uploaded:
            continue
        masked_with = [s for s in survivors if neighbours is None or s in neighbours[d]]
        dropped_seeds[d] = {
            s: derive_pairwise_mask_seed(
                shared_secret=agree(mask_keys[d], mask_publics[s]),
                site_a=d,
                site_b=s,
                round_id=config.round_id,
                round_salt=config.round_salt,
                release=release.name,
            )
            for s in masked_with
        }
    total = unmask_total(
        masked_total=masked_total,
        survivors=survivors,
        members=members,
        self_seeds=self_seeds,
        dropped_pairwise_seeds=dropped_seeds,
        length=release.length,
        round_id=config.round_id,
        release=release.name,
        neighbours=neighbours,
    )
    return release.codec().decode(total)
