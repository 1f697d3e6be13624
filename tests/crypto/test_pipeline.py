"""Integration of the primitives as the Bonawitz protocol will use them (no state machines):
X25519 + HKDF seeds, Shamir shares sealed with AES-GCM, per-release fixed-point codecs and masks,
one drop-out recovered from shares. Decoded sums equal the float64 sums to ≤1e-9 relative.
"""

from __future__ import annotations

import itertools
import math
import os

import numpy as np

from afl.crypto.aead import decrypt_share, encrypt_share
from afl.crypto.fixedpoint import FixedPointCodec
from afl.crypto.identity.signatures import generate_identity_key, sign_fields, verify_fields
from afl.crypto.kdf import (
    agree,
    derive_pairwise_mask_seed,
    derive_share_key,
    generate_agreement_key,
    load_agreement_private_key,
    new_round_salt,
    private_key_bytes,
    public_key_bytes,
)
from afl.crypto.masking import mask_input, unmask_sum
from afl.crypto.shamir import Share, reconstruct_secret, split_secret

ROUND = "round-0001"


def test_two_releases_with_one_dropout_end_to_end() -> None:
    rng = np.random.default_rng(7)  # test data only
    ids = [f"site-{i}" for i in range(5)]
    k, d, t = len(ids), 6, 3
    salt = new_round_salt()
    identity = {i: generate_identity_key() for i in ids}
    mask_key = {i: generate_agreement_key() for i in ids}
    enc_key = {i: generate_agreement_key() for i in ids}
    self_seed = {i: os.urandom(32) for i in ids}  # b_i, from the OS CSPRNG

    # AdvertiseKeys: signed public keys, verified by every peer.
    adverts = {}
    for i in ids:
        fields: list[bytes | str | int] = [
            i,
            ROUND,
            public_key_bytes(mask_key[i]),
            public_key_bytes(enc_key[i]),
        ]
        sig = sign_fields(identity[i], context="advertise-keys", fields=fields)
        verify_fields(identity[i].public_key(), sig, context="advertise-keys", fields=fields)
        adverts[i] = (public_key_bytes(mask_key[i]), public_key_bytes(enc_key[i]))

    # ShareKeys: Shamir-share the mask private key, seal each share to its recipient.
    sealed: dict[tuple[str, str], bytes] = {}
    for u in ids:
        shares = split_secret(private_key_bytes(mask_key[u]), threshold=t, n_shares=k)
        for v, share in zip(ids, shares, strict=True):
            if v == u:
                continue
            key = derive_share_key(
                shared_secret=agree(enc_key[u], adverts[v][1]),
                sender=u,
                recipient=v,
                round_id=ROUND,
                round_salt=salt,
            )
            sealed[(u, v)] = encrypt_share(
                key=key, plaintext=share.to_bytes(), sender=u, recipient=v, round_id=ROUND
            )

    # Two releases with their own codecs: a Gram-like block (up to 1e5) and a b-like block (O(1)).
    grams = {i: rng.uniform(0, 1e5, d) for i in ids}
    bs = {i: rng.uniform(-1, 1, d) for i in ids}
    codecs = {
        "gram": FixedPointCodec.for_bound(bound=1e5, max_summands=k),
        "b": FixedPointCodec.for_bound(bound=1.0, max_summands=k),
    }
    values = {"gram": grams, "b": bs}

    def seeds_of(u: str, release: str, peers: list[str]) -> dict[str, bytes]:
        return {
            v: derive_pairwise_mask_seed(
                shared_secret=agree(mask_key[u], adverts[v][0]),
                site_a=u,
                site_b=v,
                round_id=ROUND,
                round_salt=salt,
                release=release,
            )
            for v in peers
            if v != u
        }

    dropped = "site-2"
    survivors = [i for i in ids if i != dropped]
    for release, codec in codecs.items():
        uploads = {
            i: mask_input(
                encoded=codec.encode(values[release][i]),
                my_id=i,
                members=ids,
                pairwise_seeds=seeds_of(i, release, ids),
                self_seed=self_seed[i],
                round_id=ROUND,
                release=release,
            )
            for i in survivors  # the dropped site never uploads
        }

        # Unmask: t survivors decrypt their shares of the dropped site's mask key.
        opened = []
        for v in survivors[:t]:
            key = derive_share_key(
                shared_secret=agree(enc_key[v], adverts[dropped][1]),
                sender=dropped,
                recipient=v,
                round_id=ROUND,
                round_salt=salt,
            )
            blob = sealed[(dropped, v)]
            opened.append(
                Share.from_bytes(
                    decrypt_share(key=key, blob=blob, sender=dropped, recipient=v, round_id=ROUND)
                )
            )
        recovered = load_agreement_private_key(reconstruct_secret(opened, threshold=t))
        dropped_seeds = {
            s: derive_pairwise_mask_seed(
                shared_secret=agree(recovered, adverts[s][0]),
                site_a=dropped,
                site_b=s,
                round_id=ROUND,
                round_salt=salt,
                release=release,
            )
            for s in survivors
        }
        total = unmask_sum(
            masked_inputs=uploads,
            members=ids,
            self_seeds={s: self_seed[s] for s in survivors},
            dropped_pairwise_seeds={dropped: dropped_seeds},
            length=d,
            round_id=ROUND,
            release=release,
        )
        decoded = codec.decode(total)
        exact = np.array([math.fsum(values[release][s][j] for s in survivors) for j in range(d)])
        np.testing.assert_allclose(decoded, exact, rtol=1e-9, atol=0)


def test_pairwise_seeds_agree_between_peers_for_every_pair() -> None:
    ids = ["a", "b", "c", "d"]
    salt = new_round_salt()
    keys = {i: generate_agreement_key() for i in ids}
    for u, v in itertools.permutations(ids, 2):
        s_uv = derive_pairwise_mask_seed(
            shared_secret=agree(keys[u], public_key_bytes(keys[v])),
            site_a=u,
            site_b=v,
            round_id=ROUND,
            round_salt=salt,
            release="gram",
        )
        s_vu = derive_pairwise_mask_seed(
            shared_secret=agree(keys[v], public_key_bytes(keys[u])),
            site_a=v,
            site_b=u,
            round_id=ROUND,
            round_salt=salt,
            release="gram",
        )
        assert s_uv == s_vu
