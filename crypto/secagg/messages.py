"""Messages of the secure-aggregation protocol (Bonawitz et al. CCS'17; docs/protocol.md §4.2), one
frozen dataclass per message of every stage, transport-independent.

Stage              client → server                 server → client(s)
AdvertiseKeys      :class:`AdvertiseKeys`           :class:`KeyDirectory` (all adverts, U1)
ShareKeys          :class:`ShareKeysUpload`         :class:`RoutedShares` (per recipient, U2)
MaskedInput        :class:`MaskedInputUpload`       :class:`ConsistencyRequest` (U3)
ConsistencyCheck   :class:`ConsistencySignature`    :class:`UnmaskRequest` (U3, dropped, sigs)
Unmask             :class:`UnmaskResponse`          —

Signed payloads (Ed25519, :func:`afl.crypto.identity.signatures.sign_fields`), both binding the config
digest (which covers the round id, round salt, cohort, threshold, release plan, sparse graph and
the config's context: the SHA-256 of the signed plan, which binds the logged roster's digest;
:class:`afl.crypto.secagg.config.RoundConfig`):

    advert:      ("advertise-keys",  digest, round_id, salt, site, c_pk, s_pk, Δ, ρ)
                 (Δ, ρ: the digest of the graph commitments and the site's graph nonce, empty
                 with the full graph; :mod:`afl.crypto.secagg.graph`)
    consistency: ("consistency-check", digest, round_id, salt, site, |U3|, *sorted(U3))

The stages themselves are :class:`Stage`, one enum for both state machines (the client's: the
stage whose message it sends next; the server's: the messages it accepts).

Every message has ``to_bytes()``: its canonical encoding (:mod:`afl.crypto.canonical`), used for
byte accounting; the wire mapping (protobuf) is a separate layer.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
from numpy.typing import NDArray

from afl.crypto.canonical import Field, canonical_encode
from afl.crypto.errors import ProtocolError
from afl.crypto.identity.signatures import signed_messages_each
from afl.crypto.secagg.config import RoundConfig
from afl.crypto.shamir import SHARE_BYTES, Share

__all__ = [
    "ADVERTISE_CONTEXT",
    "CONSISTENCY_CONTEXT",
    "KIND_MASK_KEY",
    "KIND_SELF_MASK",
    "AdvertiseKeys",
    "ClientMessage",
    "ConsistencyRequest",
    "ConsistencySignature",
    "EncryptedShare",
    "KeyDirectory",
    "MaskedInputUpload",
    "RevealedShare",
    "RoutedShares",
    "ShareKeysUpload",
    "Stage",
    "UnmaskRequest",
    "UnmaskResponse",
    "advert_fields",
    "consistency_fields",
    "consistency_messages",
    "pack_share_bundle",
    "signed_advert_fields",
    "unpack_share_bundle",
]


class Stage(enum.Enum):
    """Stages of a round, in order, for the client and the server state machine alike."""

    ADVERTISE = "advertise-keys"
    SHARE_KEYS = "share-keys"
    MASKED_INPUT = "masked-input"
    CONSISTENCY = "consistency-check"
    UNMASK = "unmask"
    DONE = "done"
    ABORTED = "aborted"


ADVERTISE_CONTEXT = "advertise-keys"
CONSISTENCY_CONTEXT = "consistency-check"
#: Kinds of revealed shares in Unmask.
KIND_SELF_MASK: Final = "self-mask"
KIND_MASK_KEY: Final = "mask-key"
ShareKind = Literal["self-mask", "mask-key"]


def advert_fields(
    config: RoundConfig,
    *,
    site_id: str,
    enc_public: bytes,
    mask_public: bytes,
    commitments_digest: bytes = b"",
    graph_nonce: bytes = b"",
) -> tuple[Field, ...]:
    """Fields signed by a client's identity key in AdvertiseKeys."""
    return (
        config.digest(),
        config.round_id,
        config.round_salt,
        site_id,
        enc_public,
        mask_public,
        commitments_digest,
        graph_nonce,
    )


def signed_advert_fields(config: RoundConfig, advert: AdvertiseKeys) -> tuple[Field, ...]:
    """:func:`advert_fields` of a received advert."""
    return advert_fields(
        config,
        site_id=advert.site_id,
        enc_public=advert.enc_public,
        mask_public=advert.mask_public,
        commitments_digest=advert.commitments_digest,
        graph_nonce=advert.graph_nonce,
    )


def consistency_fields(
    config: RoundConfig, *, site_id: str, survivors: tuple[str, ...]
) -> tuple[Field, ...]:
    """Fields signed in ConsistencyCheck: the config, the signer and the sorted survivor list U3."""
    ordered = tuple(sorted(survivors))
    return (
        config.digest(),
        config.round_id,
        config.round_salt,
        site_id,
        len(ordered),
        *ordered,
    )


def consistency_messages(
    config: RoundConfig, *, site_ids: Sequence[str], survivors: tuple[str, ...]
) -> list[bytes]:
    """The signed messages (context :data:`CONSISTENCY_CONTEXT`) of ``site_ids``' consistency
    signatures over ``survivors``: ``signed_message(fields=consistency_fields(...))`` of each,
    with the config and the survivor list encoded once, not once per signer (O(K) per
    message made verifying K signatures O(K²) per site)."""
    ordered = tuple(sorted(survivors))
    return signed_messages_each(
        context=CONSISTENCY_CONTEXT,
        head=(config.digest(), config.round_id, config.round_salt),
        each=site_ids,
        tail=(len(ordered), *ordered),
    )


def pack_share_bundle(mask_key_share: Share, self_mask_shares: tuple[Share, ...]) -> bytes:
    """Plaintext of one encrypted ShareKeys payload: share of s_sk || shares of b_{u,R} for the
    sender's releases in plan order (fixed 68-byte records)."""
    return mask_key_share.to_bytes() + b"".join(s.to_bytes() for s in self_mask_shares)


def unpack_share_bundle(data: bytes, *, n_releases: int) -> tuple[Share, tuple[Share, ...]]:
    """Inverse of :func:`pack_share_bundle` for a sender taking part in ``n_releases`` releases."""
    if len(data) != SHARE_BYTES * (1 + n_releases):
        raise ProtocolError(
            f"share bundle has {len(data)} bytes, expected {SHARE_BYTES * (1 + n_releases)}"
        )
    records = [data[i : i + SHARE_BYTES] for i in range(0, len(data), SHARE_BYTES)]
    return Share.from_bytes(records[0]), tuple(Share.from_bytes(r) for r in records[1:])


@dataclass(frozen=True)
class AdvertiseKeys:
    """Stage 0, client → server: the two X25519 public keys (c: share encryption, s: masks),
    signed with the client's Ed25519 identity key over :func:`advert_fields`; with a sparse
    graph also the site's graph nonce and the digest of the commitments it was revealed for."""

    round_id: str
    site_id: str
    enc_public: bytes
    mask_public: bytes
    signature: bytes
    commitments_digest: bytes = b""
    graph_nonce: bytes = b""

    def to_bytes(self) -> bytes:
        return canonical_encode(
            (
                "AdvertiseKeys",
                self.round_id,
                self.site_id,
                self.enc_public,
                self.mask_public,
                self.signature,
                self.commitments_digest,
                self.graph_nonce,
            )
        )


@dataclass(frozen=True)
class KeyDirectory:
    """Stage 0, server → every client in U1: the adverts the server accepted (U1)."""

    round_id: str
    adverts: tuple[AdvertiseKeys, ...]

    def to_bytes(self) -> bytes:
        return canonical_encode(
            ("KeyDirectory", self.round_id, *(a.to_bytes() for a in self.adverts))
        )


@dataclass(frozen=True)
class EncryptedShare:
    """One AES-GCM sealed share bundle from ``sender`` to ``recipient``."""

    sender: str
    recipient: str
    ciphertext: bytes

    def to_bytes(self) -> bytes:
        return canonical_encode(("EncryptedShare", self.sender, self.recipient, self.ciphertext))


@dataclass(frozen=True)
class ShareKeysUpload:
    """Stage 1, client → server: one sealed share bundle for every other client of U1."""

    round_id: str
    site_id: str
    shares: tuple[EncryptedShare, ...]

    def to_bytes(self) -> bytes:
        return canonical_encode(
            ("ShareKeysUpload", self.round_id, self.site_id, *(s.to_bytes() for s in self.shares))
        )


@dataclass(frozen=True)
class RoutedShares:
    """Stage 1, server → one client of U2: the bundles addressed to it from U2's other members."""

    round_id: str
    recipient: str
    shares: tuple[EncryptedShare, ...]

    def to_bytes(self) -> bytes:
        return canonical_encode(
            ("RoutedShares", self.round_id, self.recipient, *(s.to_bytes() for s in self.shares))
        )


@dataclass(frozen=True, eq=False)
class MaskedInputUpload:
    """Stage 2, client → server: one masked uint64 vector y_{u,R} per release the client is in."""

    round_id: str
    site_id: str
    vectors: tuple[tuple[str, NDArray[np.uint64]], ...]

    def to_bytes(self) -> bytes:
        parts: list[Field] = ["MaskedInputUpload", self.round_id, self.site_id]
        for name, y in self.vectors:
            parts += [name, np.ascontiguousarray(y, dtype="<u8").tobytes()]
        return canonical_encode(parts)


@dataclass(frozen=True)
class ConsistencyRequest:
    """Stage 2 → 3, server → every client of U3: the survivor list U3 (sorted)."""

    round_id: str
    survivors: tuple[str, ...]

    def to_bytes(self) -> bytes:
        return canonical_encode(("ConsistencyRequest", self.round_id, *self.survivors))


@dataclass(frozen=True)
class ConsistencySignature:
    """Stage 3, client → server: the client's signature over :func:`consistency_fields`."""

    round_id: str
    site_id: str
    signature: bytes

    def to_bytes(self) -> bytes:
        return canonical_encode(
            ("ConsistencySignature", self.round_id, self.site_id, self.signature)
        )


@dataclass(frozen=True)
class UnmaskRequest:
    """Stage 3 → 4, server → every client of U4: the signed survivor list U3, the dropped sites
    (U2 \\ U3: reveal shares of their mask keys), the releases whose self masks are requested
    (reveal shares of b_{v,R} for survivors v ∈ M_R), and ≥ t consistency signatures on U3."""

    round_id: str
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    releases: tuple[str, ...]
    signatures: tuple[ConsistencySignature, ...]

    def to_bytes(self) -> bytes:
        return canonical_encode(
            (
                "UnmaskRequest",
                self.round_id,
                canonical_encode(self.survivors),
                canonical_encode(self.dropped),
                canonical_encode(self.releases),
                *(s.to_bytes() for s in self.signatures),
            )
        )


@dataclass(frozen=True)
class RevealedShare:
    """One revealed Shamir share: of ``owner``'s mask key s_sk (release "") or self-mask seed
    b_{owner,release}."""

    owner: str
    kind: ShareKind
    release: str
    share: Share

    def to_bytes(self) -> bytes:
        return canonical_encode(
            ("RevealedShare", self.owner, self.kind, self.release, self.share.to_bytes())
        )


@dataclass(frozen=True)
class UnmaskResponse:
    """Stage 4, client → server: the requested shares (never both kinds for one owner)."""

    round_id: str
    site_id: str
    shares: tuple[RevealedShare, ...]

    def to_bytes(self) -> bytes:
        return canonical_encode(
            ("UnmaskResponse", self.round_id, self.site_id, *(s.to_bytes() for s in self.shares))
        )


#: Every message a client sends to the server.
ClientMessage = (
    AdvertiseKeys | ShareKeysUpload | MaskedInputUpload | ConsistencySignature | UnmaskResponse
)
