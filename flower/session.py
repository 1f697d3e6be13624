"""A site's state between two Flower messages, sealed (docs/flower.md §3).

Flower runs a ClientApp once per message — on the deployment engine in a new process, on the
simulation engine on any of its workers — and keeps what the app must remember in the node's
``Context``, held by the SuperNode. So what afl's site keeps between the stages of a round (the
step it is at, the signed round configuration, the report so far and, in a masked round, the
protocol state machine :class:`~afl.crypto.secagg.client.SecAggClient` with its ephemeral
X25519 keys, its self-mask seeds and the shares it holds for its peers) travels in the Context,
sealed with a key only the site can derive:

    blob = salt (32 random bytes) || nonce || AES-256-GCM_K(nonce, state, AD)
    K    = HKDF-SHA256(ikm = the site's Ed25519 identity key seed, salt,
                       info = canonical(version, "flower-session", federation, "", site))
    AD   = canonical(DOMAIN_TAG, "flower-session", federation, site)

(:func:`afl.crypto.kdf.derive_key`, :func:`afl.crypto.aead.seal`). Whatever reads the Context
sees ciphertext; a blob opens only for the federation and site it was sealed for, and is
authenticated before anything in it is decoded. ``state`` is a pickle that holds no long-term key
(the identity key is a persistent reference, taken from the site's kit again when the blob is
opened; peers' identity keys and the ephemeral X25519 keys are kept as raw bytes), and the
unpickler builds only classes of :mod:`afl.crypto` and :mod:`afl.flower`, the site's round report
(:class:`afl.client.daemon.report.RoundReport`), numpy arrays and builtin containers:
:class:`SessionError` for anything else.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from afl.crypto.aead import open_sealed, seal
from afl.crypto.canonical import DOMAIN_TAG
from afl.crypto.errors import CryptoError
from afl.crypto.identity.signatures import load_public_key_raw, public_key_to_raw
from afl.crypto.kdf import derive_key, load_agreement_private_key, private_key_bytes

__all__ = ["PURPOSE", "SessionError", "open_session", "seal_session"]

PURPOSE = "flower-session"
SALT_BYTES = 32
_IDENTITY = "identity-key"
#: What the unpickler may build besides classes of afl.crypto and afl.flower.
_ALLOWED = frozenset(
    {
        ("copyreg", "_reconstructor"),
        ("builtins", "object"),
        ("afl.client.daemon.report", "RoundReport"),  # the Flower site's report so far
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
    }
)
_PACKAGES = ("afl.crypto.", "afl.flower.")


class SessionError(Exception):
    """A sealed session does not open: another site or federation, tampered, or not a session."""


def _key(identity: Ed25519PrivateKey, *, salt: bytes, federation_id: str, site_id: str) -> bytes:
    seed = identity.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )
    return derive_key(
        shared_secret=seed,
        round_salt=salt,
        purpose=PURPOSE,
        round_id=federation_id,
        release="",
        binding=(site_id,),
    )


def _associated(federation_id: str, site_id: str) -> tuple[str, ...]:
    return (DOMAIN_TAG, PURPOSE, federation_id, site_id)


def x25519_private(raw: bytes) -> X25519PrivateKey:
    """Rebuilds an ephemeral X25519 key (what the pickle holds for one)."""
    return load_agreement_private_key(raw)


def ed25519_public(raw: bytes) -> Ed25519PublicKey:
    """Rebuilds a peer's identity public key (what the pickle holds for one)."""
    return load_public_key_raw(raw)


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, identity: Ed25519PrivateKey) -> None:
        super().__init__(file, protocol=5)
        self._identity = identity

    def persistent_id(self, obj: Any) -> str | None:
        return _IDENTITY if obj is self._identity else None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, X25519PrivateKey):
            return x25519_private, (private_key_bytes(obj),)
        if isinstance(obj, Ed25519PublicKey):
            return ed25519_public, (public_key_to_raw(obj),)
        if isinstance(obj, Ed25519PrivateKey):
            raise pickle.PicklingError("no long-term key other than the site's own is kept")
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, identity: Ed25519PrivateKey) -> None:
        super().__init__(file)
        self._identity = identity

    def persistent_load(self, pid: Any) -> Any:
        if pid == _IDENTITY:
            return self._identity
        raise pickle.UnpicklingError("unknown persistent reference")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or module.startswith(_PACKAGES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a site's session")


def seal_session(
    state: object, *, identity: Ed25519PrivateKey, federation_id: str, site_id: str
) -> bytes:
    """The sealed blob of ``state`` (module docstring)."""
    buffer = io.BytesIO()
    _Pickler(buffer, identity).dump(state)
    salt = os.urandom(SALT_BYTES)
    key = _key(identity, salt=salt, federation_id=federation_id, site_id=site_id)
    return salt + seal(key, buffer.getvalue(), associated=_associated(federation_id, site_id))


def open_session(
    blob: bytes, *, identity: Ed25519PrivateKey, federation_id: str, site_id: str
) -> Any:
    """The state sealed in ``blob``; :class:`SessionError` if it does not open (module
    docstring)."""
    if len(blob) <= SALT_BYTES:
        raise SessionError("the sealed session is too short")
    salt, sealed = blob[:SALT_BYTES], blob[SALT_BYTES:]
    key = _key(identity, salt=salt, federation_id=federation_id, site_id=site_id)
    try:
        data = open_sealed(key, sealed, associated=_associated(federation_id, site_id))
    except CryptoError as exc:
        raise SessionError(
            f"the sealed session does not open for site {site_id!r} of {federation_id!r}"
        ) from exc
    try:
        return _Unpickler(io.BytesIO(data), identity).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError) as exc:
        raise SessionError(f"the sealed session does not decode: {exc}") from exc
