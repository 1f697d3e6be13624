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

__all__ = ["CHUNK_WORDS", "SEED_BYTES", "add_stream", "check_seed", "expand_seed"]

#: Length of every PRG seed: the AES-256 key size.
SEED_BYTES = 32

_MAX_WORDS = 1 << 40  # 8 TiB of output: far beyond any block; guards against absurd requests.
#: Keystream words made per AES call by :func:`add_stream` (64 KiB: with its zero input and a
#: slice of the vector it is added to, well within a core's L2 cache).
CHUNK_WORDS = 8192
_ZEROS = memoryview(bytes(8 * CHUNK_WORDS))


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
    out = np.zeros(int(n_words), dtype=np.uint64)
    add_stream(seed, out=out, context=context)
    return out


def add_stream(
    seed: bytes,
    *,
    out: NDArray[np.uint64],
    context: Sequence[Field] = (),
    subtract: bool = False,
) -> NDArray[np.uint64]:
    """``out`` ± PRG(seed, context)[0:len(out)] (mod 2^64), in place; ``out`` returned.

    The same words as ``out + expand_seed(seed, n_words=len(out), context=context)``, without
    the stream in memory: the keystream is made :data:`CHUNK_WORDS` at a time into one buffer
    and added slice by slice, so the zeros it encrypts, the keystream and the slice of ``out``
    stay in the core's cache (a whole stream of a d = 1024 Gram, 4 MiB, and its zero input did
    not, and each call mapped and faulted in fresh pages for both).

    Raises:
        InvalidSeedError: seed is not exactly 32 bytes.
        ValueError: ``out`` is not a writable, contiguous 1-D uint64 vector.
    """
    check_seed(seed)
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != np.uint64
        or out.ndim != 1
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ValueError("out must be a writable, contiguous 1-D uint64 vector")
    n = out.shape[0]
    if n > _MAX_WORDS:
        raise ValueError(f"out must hold at most 2^40 words, got {n}")
    if n == 0:
        return out
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(_iv(context))).encryptor()
    # update_into writes the keystream straight into the buffer, which must have
    # block_size - 1 spare bytes; a chunk is a whole number of AES blocks, so the counter
    # runs on across chunks exactly as in one call.
    size = min(n, CHUNK_WORDS)
    buffer = bytearray(8 * size + 15)
    keystream = np.frombuffer(buffer, dtype="<u8", count=size)
    combine = np.subtract if subtract else np.add
    for start in range(0, n, CHUNK_WORDS):
        m = min(size, n - start)
        if encryptor.update_into(_ZEROS[: 8 * m], buffer) != 8 * m:
            raise RuntimeError("AES-CTR produced an unexpected amount of keystream")
        part = out[start : start + m]
        combine(part, keystream[:m], out=part)
    if encryptor.finalize():
        raise RuntimeError("AES-CTR produced an unexpected amount of keystream")
    return out
