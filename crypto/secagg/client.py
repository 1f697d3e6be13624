"""Client state machine of secure aggregation (Bonawitz et al. CCS'17; docs/protocol.md §4.2).

Stages (each method checks it is called in its stage, else :class:`StageError`):

    ADVERTISE → SHARE_KEYS → MASKED_INPUT → CONSISTENCY → UNMASK → DONE   (or ABORTED)

For each release R the client is a member of, it uploads

    y_{u,R} = x_{u,R} + Σ_{v ∈ M_R ∩ U2, v > u} PRG(s_uv; R) - Σ_{v < u} PRG(s_uv; R)
              + PRG(b_{u,R}; R)   (mod 2^64)

(:func:`afl.crypto.masking.mask_input`), with x the fixed-point encoding, s_uv from X25519 of the
s keys + HKDF bound to (round, salt, release), and a fresh self-mask seed b_{u,R} per release.
s_sk and each b_{u,R} are Shamir-shared t-of-n over U1; shares travel AES-GCM sealed under the
HKDF key of the c-key agreement.

With a sparse graph (``config.graph``, SecAgg+) the peers v above are u's neighbours N(u) only,
and the secrets are shared t_N-of-(k + 1) among N(u) and u. The client reveals its graph nonce in
AdvertiseKeys, bound to the digest of every participant's commitment (which the caller checked
against the kit's keys), and derives the graph itself from every participant's advert: a
directory that lacks a participant, carries another commitment digest or a nonce that does not
open its commitment is refused (:mod:`afl.crypto.secagg.graph`). It checks its own neighbourhood
only where it can see it: U2 and the dropped sites among its neighbours.

Unmask safety rules (the client refuses with :class:`UnmaskRefusedError` and aborts):
the request's survivors must equal the U3 the client signed and carry ≥ t valid signatures on
it; no site may be both a survivor and dropped; dropped sites must be in U2 \\ U3; self-mask
shares only for releases with ≥ t_R surviving members, and, for a release this client is a
member of, with at least its own floor (``survivor_floors``: the site's policy, whatever t_R the
plan says); and the client never reveals both a self-mask share and the mask-key share of the
same peer, across its whole lifetime.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from numpy.typing import ArrayLike, NDArray

from afl.crypto.aead import decrypt_share, encrypt_share
from afl.crypto.errors import (
    CryptoError,
    ProtocolError,
    RoundAbortedError,
    RoundMismatchError,
    StageError,
    UnmaskRefusedError,
)
from afl.crypto.identity.signatures import sign_fields, verify, verify_fields
from afl.crypto.kdf import (
    agree,
    derive_pairwise_mask_seed,
    derive_share_key,
    generate_agreement_key,
    private_key_bytes,
    public_key_bytes,
)
from afl.crypto.masking import mask_input
from afl.crypto.prg import SEED_BYTES
from afl.crypto.secagg.config import RoundConfig
from afl.crypto.secagg.graph import (
    commitments_digest,
    derive_neighbourhood,
    graph_commitment,
    graph_seed,
)
from afl.crypto.secagg.messages import (
    ADVERTISE_CONTEXT,
    CONSISTENCY_CONTEXT,
    KIND_MASK_KEY,
    KIND_SELF_MASK,
    AdvertiseKeys,
    ConsistencyRequest,
    ConsistencySignature,
    EncryptedShare,
    KeyDirectory,
    MaskedInputUpload,
    RevealedShare,
    RoutedShares,
    ShareKeysUpload,
    Stage,
    UnmaskRequest,
    UnmaskResponse,
    advert_fields,
    consistency_fields,
    consistency_messages,
    pack_share_bundle,
    signed_advert_fields,
    unpack_share_bundle,
)
from afl.crypto.shamir import Share, split_secret_at

__all__ = ["SecAggClient"]


class SecAggClient:
    """One site's side of one round. ``inputs`` maps each release the site is a member of to its
    flat float64 vector (|x| <= the release bound); ``identities`` maps site id → Ed25519 public
    identity key (from provisioning), used to verify peers' adverts and consistency signatures;
    ``survivor_floors`` maps a release to the fewest surviving members with which this client
    reveals self-mask shares of it (the site's own policy; the plan's t_R applies too);
    ``graph_nonce`` is the nonce ρ the site committed to at plan review (sparse graph only)."""

    def __init__(
        self,
        *,
        site_id: str,
        identity_key: Ed25519PrivateKey,
        config: RoundConfig,
        identities: Mapping[str, Ed25519PublicKey],
        inputs: Mapping[str, ArrayLike],
        survivor_floors: Mapping[str, int] | None = None,
        graph_nonce: bytes | None = None,
    ) -> None:
        if site_id not in config.cohort:
            raise ProtocolError(f"site {site_id!r} is not in the round's cohort")
        if (config.graph is None) != (graph_nonce is None):
            raise ProtocolError("a graph nonce is needed with a sparse graph, and only then")
        self._graph_nonce = graph_nonce or b""
        self._commitments: dict[str, bytes] = {}
        self._digest = b""
        self._neighbours: frozenset[str] = frozenset(config.cohort) - {site_id}
        self.site_id = site_id
        self.config = config
        self._identity = identity_key
        self._identities = dict(identities)
        self._floors = dict(survivor_floors or {})
        self._releases = config.releases_of(site_id)
        expected = {r.name for r in self._releases}
        if set(inputs) != expected:
            raise ProtocolError(
                f"site {site_id!r} must give inputs for exactly its releases {sorted(expected)}, "
                f"got {sorted(inputs)}"
            )
        self._encoded: dict[str, NDArray[np.uint64]] = {}
        for release in self._releases:
            x = np.asarray(inputs[release.name], dtype=np.float64)
            if x.shape != (release.length,):
                raise ProtocolError(
                    f"release {release.name!r}: input must have shape ({release.length},), "
                    f"got {x.shape}"
                )
            self._encoded[release.name] = release.codec().encode(x)  # rejects |x| > bound
        self.stage = Stage.ADVERTISE
        self._enc_key = generate_agreement_key()
        self._mask_key = generate_agreement_key()
        self._self_seeds = {r.name: os.urandom(SEED_BYTES) for r in self._releases}
        self._peers: dict[str, tuple[bytes, bytes]] = {}  # U1: site -> (c_pk, s_pk)
        self._u2: tuple[str, ...] = ()
        self._held_mask_key: dict[str, Share] = {}  # owner -> my share of s_sk_owner
        self._held_self: dict[str, dict[str, Share]] = {}  # owner -> release -> share of b
        self._signed_u3: tuple[str, ...] | None = None
        self._revealed: dict[str, str] = {}  # owner -> kind revealed (never both)

    # -- helpers -------------------------------------------------------------------------------
    def _expect(self, stage: Stage, round_id: str) -> None:
        if self.stage is not stage:
            raise StageError(
                f"client {self.site_id!r} is in stage {self.stage.value}, not {stage.value}"
            )
        if round_id != self.config.round_id:
            raise RoundMismatchError(
                f"message for round {round_id!r}, this client runs {self.config.round_id!r}"
            )

    def _abort(self, error: ProtocolError) -> ProtocolError:
        self.stage = Stage.ABORTED
        return error

    def _need_t(self, what: str, count: int) -> None:
        if count < self.config.t:
            raise self._abort(
                RoundAbortedError(
                    f"{what}: {count} live clients, fewer than the threshold t={self.config.t}"
                )
            )

    def _need_neighbours(self, count: int) -> None:
        """Sparse graph: the site masks with the neighbours whose shares reached it. With fewer
        than k - D of them (D = n - t, the drop-outs the plan tolerates) the coordinator has
        withheld shares (with none, the upload would carry only the self mask, which the
        neighbours reveal for a survivor): abort before masking anything."""
        graph = self.config.graph
        assert graph is not None
        floor = graph.degree - (len(self.config.cohort) - self.config.t)
        if count < floor:
            raise self._abort(
                RoundAbortedError(
                    f"ShareKeys: shares from {count} of this site's {graph.degree} neighbours, "
                    f"fewer than k - D = {floor}: the coordinator withheld shares"
                )
            )

    # -- stage 0 -------------------------------------------------------------------------------
    def advertise_keys(self, commitments: Mapping[str, bytes] | None = None) -> AdvertiseKeys:
        """Stage 0: sign and send (c_pk, s_pk); with a sparse graph also the nonce ρ, bound to the
        digest of ``commitments`` (every participant's graph commitment, already verified)."""
        self._expect(Stage.ADVERTISE, self.config.round_id)
        if self.config.graph is not None:
            self._take_commitments(commitments)
        elif commitments:
            raise self._abort(ProtocolError("graph commitments in a round with the full graph"))
        c_pk, s_pk = public_key_bytes(self._enc_key), public_key_bytes(self._mask_key)
        fields = advert_fields(
            self.config,
            site_id=self.site_id,
            enc_public=c_pk,
            mask_public=s_pk,
            commitments_digest=self._digest,
            graph_nonce=self._graph_nonce,
        )
        signature = sign_fields(self._identity, context=ADVERTISE_CONTEXT, fields=fields)
        self.stage = Stage.SHARE_KEYS
        return AdvertiseKeys(
            self.config.round_id,
            self.site_id,
            c_pk,
            s_pk,
            signature,
            self._digest,
            self._graph_nonce,
        )

    def _take_commitments(self, commitments: Mapping[str, bytes] | None) -> None:
        given = dict(commitments or {})
        if set(given) != set(self.config.cohort):
            missing = sorted(set(self.config.cohort) - set(given))
            raise self._abort(
                RoundAbortedError(
                    f"graph commitments missing for {missing} (or given for non-participants); "
                    "the sparse graph needs every participant's"
                )
            )
        mine = graph_commitment(
            round_id=self.config.round_id, site_id=self.site_id, nonce=self._graph_nonce
        )
        if given[self.site_id] != mine:
            raise self._abort(
                ProtocolError("the graph commitments carry another one for this site")
            )
        self._commitments = given
        self._digest = commitments_digest(given)

    def _derive_neighbours(self, adverts: Mapping[str, AdvertiseKeys]) -> None:
        """Sparse graph: every participant's nonce, opening its commitment, for the same list."""
        graph = self.config.graph
        assert graph is not None
        missing = sorted(set(self.config.cohort) - set(adverts))
        if missing:
            raise self._abort(
                RoundAbortedError(
                    f"no graph nonce from {missing}: the sparse graph is drawn from every "
                    "participant's nonce; round aborted"
                )
            )
        for site, advert in adverts.items():
            if advert.commitments_digest != self._digest:
                raise self._abort(
                    ProtocolError(f"the advert of {site!r} was made for other graph commitments")
                )
            opened = graph_commitment(
                round_id=self.config.round_id, site_id=site, nonce=advert.graph_nonce
            )
            if opened != self._commitments[site]:
                raise self._abort(
                    ProtocolError(f"the graph nonce of {site!r} does not open its commitment")
                )
        seed = graph_seed(
            config_digest=self.config.digest(),
            digest=self._digest,
            nonces={s: a.graph_nonce for s, a in adverts.items()},
        )
        self._neighbours = derive_neighbourhood(
            self.config.cohort, degree=graph.degree, seed=seed, site=self.site_id
        )

    @property
    def neighbours(self) -> frozenset[str]:
        """N(u): every other site with the full graph, the derived neighbourhood otherwise."""
        return self._neighbours

    # -- stage 1 -------------------------------------------------------------------------------
    def share_keys(self, directory: KeyDirectory) -> ShareKeysUpload:
        """Stage 1: verify U1's adverts, then Shamir-share s_sk and each b_{u,R} to U1."""
        self._expect(Stage.SHARE_KEYS, directory.round_id)
        peers: dict[str, tuple[bytes, bytes]] = {}
        adverts: dict[str, AdvertiseKeys] = {}
        for advert in directory.adverts:
            site = advert.site_id
            if site not in self.config.cohort or site in peers or site not in self._identities:
                raise self._abort(
                    ProtocolError(f"key directory: unknown or repeated site {site!r}")
                )
            fields = signed_advert_fields(self.config, advert)
            try:
                verify_fields(
                    self._identities[site],
                    advert.signature,
                    context=ADVERTISE_CONTEXT,
                    fields=fields,
                )
            except CryptoError as exc:
                raise self._abort(ProtocolError(f"advert of {site!r} does not verify")) from exc
            peers[site] = (advert.enc_public, advert.mask_public)
            adverts[site] = advert
        mine = (public_key_bytes(self._enc_key), public_key_bytes(self._mask_key))
        if peers.get(self.site_id) != mine:
            raise self._abort(ProtocolError("key directory does not carry this client's keys"))
        self._need_t("AdvertiseKeys", len(peers))
        if self.config.graph is not None:
            self._derive_neighbours(adverts)
        self._peers = peers
        holders = sorted(v for v in peers if v in self._neighbours or v == self.site_id)
        t = self.config.share_threshold
        if len(holders) < t:
            raise self._abort(
                RoundAbortedError(f"only {len(holders)} share holders, fewer than t={t}")
            )
        xs = [self.config.share_index(v) for v in holders]
        key_shares = split_secret_at(private_key_bytes(self._mask_key), threshold=t, indices=xs)
        seed_shares = [
            split_secret_at(self._self_seeds[r.name], threshold=t, indices=xs)
            for r in self._releases
        ]
        sealed: list[EncryptedShare] = []
        for i, v in enumerate(holders):
            bundle_self = tuple(s[i] for s in seed_shares)
            if v == self.site_id:  # my own shares stay with me
                self._store_held(v, key_shares[i], bundle_self)
                continue
            key = self._share_key(sender=self.site_id, recipient=v)
            plaintext = pack_share_bundle(key_shares[i], bundle_self)
            blob = encrypt_share(
                key=key,
                plaintext=plaintext,
                sender=self.site_id,
                recipient=v,
                round_id=self.config.round_id,
            )
            sealed.append(EncryptedShare(self.site_id, v, blob))
        self.stage = Stage.MASKED_INPUT
        return ShareKeysUpload(self.config.round_id, self.site_id, tuple(sealed))

    def _share_key(self, *, sender: str, recipient: str) -> bytes:
        other = recipient if sender == self.site_id else sender
        return derive_share_key(
            shared_secret=agree(self._enc_key, self._peers[other][0]),
            sender=sender,
            recipient=recipient,
            round_id=self.config.round_id,
            round_salt=self.config.round_salt,
        )

    def _store_held(self, owner: str, key_share: Share, self_shares: tuple[Share, ...]) -> None:
        names = [r.name for r in self.config.releases_of(owner)]
        self._held_mask_key[owner] = key_share
        self._held_self[owner] = dict(zip(names, self_shares, strict=True))

    # -- stage 2 -------------------------------------------------------------------------------
    def masked_input(self, routed: RoutedShares) -> MaskedInputUpload:
        """Stage 2: open the shares from U2, then mask every release among M_R ∩ U2."""
        self._expect(Stage.MASKED_INPUT, routed.round_id)
        if routed.recipient != self.site_id:
            raise self._abort(ProtocolError("routed shares are addressed to another client"))
        my_index = self.config.share_index(self.site_id)
        for item in routed.shares:
            owner = item.sender
            if item.recipient != self.site_id or owner not in self._peers:
                raise self._abort(ProtocolError(f"routed share from unknown site {owner!r}"))
            if owner not in self._neighbours:
                raise self._abort(ProtocolError(f"routed share from {owner!r}, not a neighbour"))
            if owner == self.site_id or owner in self._held_mask_key:
                raise self._abort(ProtocolError(f"duplicate routed share from {owner!r}"))
            try:
                plaintext = decrypt_share(
                    key=self._share_key(sender=owner, recipient=self.site_id),
                    blob=item.ciphertext,
                    sender=owner,
                    recipient=self.site_id,
                    round_id=self.config.round_id,
                )
                key_share, self_shares = unpack_share_bundle(
                    plaintext, n_releases=len(self.config.releases_of(owner))
                )
            except CryptoError as exc:
                raise self._abort(ProtocolError(f"share bundle from {owner!r}: {exc}")) from exc
            if {key_share.index, *(s.index for s in self_shares)} != {my_index}:
                raise self._abort(ProtocolError(f"share bundle from {owner!r} has wrong indices"))
            self._store_held(owner, key_share, self_shares)
        self._u2 = tuple(sorted(self._held_mask_key))  # U2 as far as this client sees it
        if self.config.graph is None:
            self._need_t("ShareKeys", len(self._u2))
        else:
            self._need_neighbours(len(self._u2) - 1)
        vectors: list[tuple[str, NDArray[np.uint64]]] = []
        secrets_with = {v: agree(self._mask_key, self._peers[v][1]) for v in self._u2}
        for release in self._releases:
            live = [m for m in release.members if m in self._held_mask_key]
            seeds = {
                v: derive_pairwise_mask_seed(
                    shared_secret=secrets_with[v],
                    site_a=self.site_id,
                    site_b=v,
                    round_id=self.config.round_id,
                    round_salt=self.config.round_salt,
                    release=release.name,
                )
                for v in live
                if v != self.site_id
            }
            y = mask_input(
                encoded=self._encoded.pop(release.name),
                overwrite=True,
                my_id=self.site_id,
                members=live,
                pairwise_seeds=seeds,
                self_seed=self._self_seeds[release.name],
                round_id=self.config.round_id,
                release=release.name,
            )
            vectors.append((release.name, y))
        self._encoded.clear()  # the plaintext encoding is no longer needed
        self.stage = Stage.CONSISTENCY
        return MaskedInputUpload(self.config.round_id, self.site_id, tuple(vectors))

    # -- stage 3 -------------------------------------------------------------------------------
    def consistency_check(self, request: ConsistencyRequest) -> ConsistencySignature:
        """Stage 3: sign the survivor list U3 (once), after checking U3 ⊆ U2, |U3| ≥ t, u ∈ U3."""
        self._expect(Stage.CONSISTENCY, request.round_id)
        u3 = tuple(sorted(set(request.survivors)))
        local = self._neighbours | {self.site_id}
        if (
            len(u3) != len(request.survivors)
            or not set(u3) <= set(self.config.cohort)
            or not set(u3) & local <= set(self._u2)
        ):
            raise self._abort(ProtocolError("survivor list has repeats or sites outside U2"))
        if self.site_id not in u3:
            raise self._abort(ProtocolError("survivor list omits this client, which uploaded"))
        self._need_t("MaskedInput", len(u3))
        fields = consistency_fields(self.config, site_id=self.site_id, survivors=u3)
        signature = sign_fields(self._identity, context=CONSISTENCY_CONTEXT, fields=fields)
        self._signed_u3 = u3
        self.stage = Stage.UNMASK
        return ConsistencySignature(self.config.round_id, self.site_id, signature)

    # -- stage 4 -------------------------------------------------------------------------------
    def unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Stage 4: reveal b-shares of survivors (requested releases) and s_sk-shares of dropped
        sites, after the safety checks of the module docstring."""
        self._expect(Stage.UNMASK, request.round_id)
        try:
            shares = self._check_and_collect(request)
        except UnmaskRefusedError as exc:
            raise self._abort(exc) from None
        self.stage = Stage.DONE
        return UnmaskResponse(self.config.round_id, self.site_id, shares)

    def _refuse(self, reason: str) -> UnmaskRefusedError:
        return UnmaskRefusedError(f"client {self.site_id!r} refuses Unmask: {reason}")

    def _check_and_collect(self, request: UnmaskRequest) -> tuple[RevealedShare, ...]:
        survivors, dropped = set(request.survivors), set(request.dropped)
        both = survivors & dropped
        if both:
            raise self._refuse(f"it asks for both shares of {sorted(both)}")
        if tuple(sorted(survivors)) != self._signed_u3 or len(survivors) != len(request.survivors):
            raise self._refuse("its survivor list differs from the one this client signed")
        assert self._signed_u3 is not None
        # U2 \ U3 as far as this client sees it: the dropped sites among those whose shares it
        # holds (everyone with the full graph, its neighbours with a sparse one).
        known = set(self._u2)
        expected_dropped = known - survivors
        local = self._neighbours | {self.site_id}
        if not dropped <= set(self.config.cohort) or dropped & local != expected_dropped:
            raise self._refuse(
                f"dropped sites {sorted(dropped)} are not U2 \\ U3 = {sorted(expected_dropped)}"
            )
        self._verify_consistency_signatures(request)
        names = set(request.releases)
        for name in names:
            release = self.config.release(name)
            alive = len(set(release.members) & survivors)
            need = max(release.min_survivors, self._floors.get(name, 0))
            if alive < need:
                raise self._refuse(
                    f"release {name!r} has {alive} survivors, fewer than its minimum {need}"
                )
        out: list[RevealedShare] = []
        for owner in sorted(dropped & known):
            if self._revealed.get(owner, KIND_MASK_KEY) != KIND_MASK_KEY:
                raise self._refuse(f"it already revealed a self-mask share of {owner!r}")
            self._revealed[owner] = KIND_MASK_KEY
            out.append(RevealedShare(owner, KIND_MASK_KEY, "", self._held_mask_key[owner]))
        for owner in sorted(survivors & known):
            if self._revealed.get(owner, KIND_SELF_MASK) != KIND_SELF_MASK:
                raise self._refuse(f"it already revealed the mask-key share of {owner!r}")
            self._revealed[owner] = KIND_SELF_MASK
            for name, share in sorted(self._held_self[owner].items()):
                if name in names:
                    out.append(RevealedShare(owner, KIND_SELF_MASK, name, share))
        return tuple(out)

    def _verify_consistency_signatures(self, request: UnmaskRequest) -> None:
        """At least t distinct survivors signed the U3 this client signed (M-10). Every entry
        must name a distinct survivor; signatures are verified in the request's order until t
        verified (one that fails before then refuses the request), and any after the t-th are
        neither verified nor counted: t valid ones are the guarantee, and a K-site round's
        request carries up to K of them."""
        assert self._signed_u3 is not None
        t = self.config.t
        messages = consistency_messages(
            self.config,
            site_ids=[item.site_id for item in request.signatures[:t]],
            survivors=self._signed_u3,
        )  # the survivor list encoded once, not once per signature
        named: set[str] = set()
        signers: set[str] = set()
        for position, item in enumerate(request.signatures):
            if item.site_id not in self._signed_u3 or item.site_id in named:
                raise self._refuse(f"signature from {item.site_id!r} is not a distinct survivor")
            named.add(item.site_id)
            if position >= t:
                continue
            try:
                verify(self._identities[item.site_id], item.signature, messages[position])
            except CryptoError:
                raise self._refuse(
                    f"the consistency signature of {item.site_id!r} is not on the survivor "
                    "list this client signed"
                ) from None
            signers.add(item.site_id)
        if len(signers) < self.config.t:
            raise self._refuse(
                f"only {len(signers)} consistency signatures, fewer than t={self.config.t}"
            )
