"""Signed, sealed CKKS aggregate tags (afl.crypto.ckks.wire; docs/protocol.md §4.3): a site's
tags open at the decryptor only if that site signed them for exactly this binding (federation,
round, plan digest, sender, decryptor, decryptor key); anyone else, the coordinator included,
can seal a blob to the decryptor but cannot make it pass as a site's."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto import kdf
from afl.crypto.ckks.wire import SealedTags, TagBinding, open_tags, seal_tags
from afl.crypto.errors import CryptoError, DecryptionError, SignatureError
from afl.crypto.identity import signatures

SITE = signatures.generate_identity_key()
DECRYPTOR = kdf.generate_agreement_key()


def _binding(**change: object) -> TagBinding:
    base = TagBinding(
        federation_id="fed",
        round_id="r1-abc",
        round_salt=b"\x07" * 32,
        plan_sha256=b"\x08" * 32,
        sender="site-1",
        recipient="dec",
        recipient_key=kdf.public_key_bytes(DECRYPTOR),
    )
    return dataclasses.replace(base, **change)  # type: ignore[arg-type]


def _open(sealed: SealedTags, binding: TagBinding) -> bytes:
    return open_tags(
        sealed, binding=binding, sender_identity=SITE.public_key(), recipient_private_key=DECRYPTOR
    )


@settings(max_examples=25)
@given(plaintext=st.binary(max_size=200), round_id=st.text(min_size=1, max_size=20))
def test_honest_tags_round_trip(plaintext: bytes, round_id: str) -> None:
    binding = _binding(round_id=round_id)
    sealed = seal_tags(plaintext, binding=binding, identity_key=SITE)
    assert _open(sealed, binding) == plaintext


_CHANGES = st.sampled_from(
    [
        {"federation_id": "other-fed"},
        {"round_id": "r1-other"},
        {"round_salt": b"\x09" * 32},
        {"plan_sha256": b"\x0a" * 32},
        {"sender": "site-2"},
        {"recipient": "dec-2"},
    ]
)


@settings(max_examples=25)
@given(change=_CHANGES)
def test_any_other_binding_fails(change: dict[str, object]) -> None:
    sealed = seal_tags(b"tags", binding=_binding(), identity_key=SITE)
    with pytest.raises(CryptoError):
        _open(sealed, _binding(**change))


@settings(max_examples=25)
@given(
    part=st.sampled_from(["ephemeral_public_key", "blob", "signature"]),
    position=st.integers(0, 31),
    bit=st.integers(0, 7),
)
def test_any_flipped_bit_fails(part: str, position: int, bit: int) -> None:
    sealed = seal_tags(b"tags", binding=_binding(), identity_key=SITE)
    raw = bytearray(getattr(sealed, part))
    raw[position % len(raw)] ^= 1 << bit
    with pytest.raises(CryptoError):
        _open(dataclasses.replace(sealed, **{part: bytes(raw)}), _binding())


def test_a_blob_sealed_by_anyone_else_does_not_pass_as_the_sites() -> None:
    impostor = signatures.generate_identity_key()  # e.g. the coordinator's own key
    forged = seal_tags(b"+1000", binding=_binding(), identity_key=impostor)
    with pytest.raises(SignatureError):
        _open(forged, _binding())
    # Re-signing the site's own sealed blob with another key does not work either, and the
    # site's signature does not cover another blob.
    honest = seal_tags(b"tags", binding=_binding(), identity_key=SITE)
    with pytest.raises(SignatureError):
        _open(dataclasses.replace(honest, signature=forged.signature), _binding())
    with pytest.raises(SignatureError):
        _open(dataclasses.replace(forged, signature=honest.signature), _binding())


def test_without_a_signature_nothing_opens() -> None:
    honest = seal_tags(b"tags", binding=_binding(), identity_key=SITE)
    with pytest.raises(SignatureError):
        _open(dataclasses.replace(honest, signature=b""), _binding())


def test_only_the_bound_decryptor_key_opens() -> None:
    sealed = seal_tags(b"tags", binding=_binding(), identity_key=SITE)
    other = kdf.generate_agreement_key()
    with pytest.raises(CryptoError):
        open_tags(
            sealed,
            binding=_binding(),
            sender_identity=SITE.public_key(),
            recipient_private_key=other,
        )
    with pytest.raises((SignatureError, DecryptionError)):  # bound to the other key
        open_tags(
            sealed,
            binding=_binding(recipient_key=kdf.public_key_bytes(other)),
            sender_identity=SITE.public_key(),
            recipient_private_key=other,
        )
