"""Mask PRG: AES-256-CTR keyed by a full 32-byte seed (docs/protocol.md §5).

    PRG(s, ctx)[0:n] = little-endian uint64 words of AES-256-CTR_s(IV(ctx), 0^{8n})

with IV(ctx) = SHA-256("afl-prg" || canonical(ctx))[0:8] || 0^8: the first 64 bits of the counter
block bind the context (protocol version, round, release, purpose), the last 64 bits count blocks
from zero, so streams for different contexts do not overlap for any n < 2^67 words.

The whole 256-bit seed is the AES key: no folding to 32 bits and no numpy RNG (the weaknesses of
Flower's SecAgg+).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from numpy.typing import NDArray

from afl.crypto.canonical import Field, canonical_encode
from afl.crypto.errors import InvalidSeedError

__all__ = ["SEED_BYTES", "check_seed", "expand_seed"]

#: Length of every PRG seed: the AES-256 key size.
SEED_BYTES = 32

_MAX_WORDS = 1 << 40  # 8 TiB of output: far beyond any block; guards against absurd requests.


def check_seed(seed: object, *, what: str = "seed") -> bytes:
    """Return ``seed`` if it is exactly 32 bytes, else raise :class:`InvalidSeedError`."""
    if not isinstance(seed, bytes):
        raise InvalidSeedError(f"{what} must be bytes, got {type(seed).__name__}")
    if len(seed) != SEED_BYTES:
        raise InvalidSeedError(f"{what} must be exactly {SEED_BYTES} bytes, got {len(seed)}")
    return seed


def _iv(context: Sequence[Field]) -> bytes:
    digest = hashlib.sha256(b"afl-prg" + canonical_encode(context)).digest()
    return digest[:8] + bytes(8)


def expand_seed(seed: bytes, *, n_words: int, context: Sequence[Field] = ()) -> NDArray[np.uint64]:
    """Expand a 32-byte seed into ``n_words`` uniform uint64 words (deterministic in seed, context).

    Raises:
        InvalidSeedError: seed is not exactly 32 bytes.
        ValueError: n_words is negative or absurdly large.
    """
    check_seed(seed)
    if isinstance(n_words, bool) or not isinstance(n_words, int | np.integer):
        raise ValueError(f"n_words must be an int, got {type(n_words).__name__}")
    if not 0 <= n_words <= _MAX_WORDS:
        raise ValueError(f"n_words must be in [0, 2^40], got {n_words}")
    n = int(n_words)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(_iv(context))).encryptor()
    # update_into writes the keystream straight into a writable buffer (no extra copies); the
    # output buffer must have block_size - 1 spare bytes.
    out = bytearray(8 * n + 15)
    written = encryptor.update_into(bytes(8 * n), out)
    if written != 8 * n or encryptor.finalize():
        raise RuntimeError("AES-CTR produced an unexpected amount of keystream")
    return np.frombuffer(out, dtype="<u8", count=n).astype(np.uint64, copy=False)
