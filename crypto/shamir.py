"""Shamir t-of-n secret sharing of 32-byte secrets over GF(p), p = 2^521 - 1 (docs/protocol.md §5).

Split: pick a_1 .. a_{t-1} uniformly in GF(p) with the ``secrets`` CSPRNG and set

    f(x) = s + a_1 x + ... + a_{t-1} x^{t-1} (mod p),   share_i = (i, f(i)),  i = 1..n,

where s < 2^256 is the secret read as a big-endian integer. Reconstruct: Lagrange interpolation
at zero, f(0) = Σ_i y_i Π_{j≠i} x_j / (x_j - x_i) (mod p). Any t shares determine s; any t-1
shares are uniformly distributed independently of s.

Why p = 2^521 - 1: it is a well-known Mersenne prime larger than 2^256, so every 256-bit secret
(X25519 private keys, self-mask seeds) embeds without reduction and no curve-specific prime is
needed; shares serialize to a fixed 2 + 66 bytes.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from afl.crypto.errors import ShamirError

__all__ = [
    "PRIME",
    "SECRET_BYTES",
    "SHARE_BYTES",
    "VALUE_BYTES",
    "Share",
    "interpolate_at_zero",
    "lagrange_weights_at_zero",
    "reconstruct_many",
    "reconstruct_secret",
    "split_secret",
    "split_secret_at",
]

#: The field modulus: the Mersenne prime 2^521 - 1.
PRIME = (1 << 521) - 1
SECRET_BYTES = 32
VALUE_BYTES = (PRIME.bit_length() + 7) // 8  # 66
_INDEX_BYTES = 2
SHARE_BYTES = _INDEX_BYTES + VALUE_BYTES
MAX_SHARES = (1 << (8 * _INDEX_BYTES)) - 1


@dataclass(frozen=True)
class Share:
    """One share (x, y) = (index, f(index)) with index in 1..65535 and value in [0, p)."""

    index: int
    value: int

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int):
            raise ShamirError("share index must be an int")
        if not 1 <= self.index <= MAX_SHARES:
            raise ShamirError(f"share index must be in 1..{MAX_SHARES}, got {self.index}")
        if isinstance(self.value, bool) or not isinstance(self.value, int):
            raise ShamirError("share value must be an int")
        if not 0 <= self.value < PRIME:
            raise ShamirError("share value is not a field element")

    def __repr__(self) -> str:  # never print share values (secret material)
        return f"Share(index={self.index}, value=<redacted>)"

    def to_bytes(self) -> bytes:
        """u16be(index) || u528be(value): 68 bytes."""
        return self.index.to_bytes(_INDEX_BYTES, "big") + self.value.to_bytes(VALUE_BYTES, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> Share:
        """Inverse of :meth:`to_bytes`; :class:`ShamirError` if malformed."""
        if not isinstance(data, bytes) or len(data) != SHARE_BYTES:
            raise ShamirError(f"a serialized share must be exactly {SHARE_BYTES} bytes")
        index = int.from_bytes(data[:_INDEX_BYTES], "big")
        value = int.from_bytes(data[_INDEX_BYTES:], "big")
        return cls(index=index, value=value)


def _check_params(threshold: int, n_shares: int) -> None:
    for name, value in (("threshold", threshold), ("n_shares", n_shares)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ShamirError(f"{name} must be an int")
    if threshold < 1:
        raise ShamirError(f"threshold must be >= 1, got {threshold}")
    if n_shares > MAX_SHARES:
        raise ShamirError(f"at most {MAX_SHARES} shares are supported, got {n_shares}")
    if threshold > n_shares:
        raise ShamirError(f"threshold t={threshold} exceeds the number of shares n={n_shares}")


def _eval_poly(coefficients: Sequence[int], x: int) -> int:
    """f(x) mod p by Horner's rule, reduced once at the end: x < 2^16, so the t-1 steps grow
    the integer by 16 bits each (about 1,000 bits for t = 30), cheaper than 30 reductions."""
    acc = 0
    for c in reversed(coefficients):
        acc = acc * x + c
    return acc % PRIME


def split_secret(secret: bytes, *, threshold: int, n_shares: int) -> list[Share]:
    """Split a 32-byte secret into ``n_shares`` shares, any ``threshold`` of which recover it.

    Raises:
        ShamirError: secret not 32 bytes, threshold < 1, threshold > n_shares, n_shares too large.
    """
    _check_params(threshold, n_shares)
    return split_secret_at(secret, threshold=threshold, indices=range(1, n_shares + 1))


def split_secret_at(secret: bytes, *, threshold: int, indices: Sequence[int]) -> list[Share]:
    """Shares (x, f(x)) of a 32-byte secret at the given distinct x-coordinates only, any
    ``threshold`` of which recover it: the same polynomial as :func:`split_secret`, evaluated
    where the holders are (a sparse masking graph shares among a site's neighbours only, so its
    cost is O(k·t) instead of O(n·t)).

    Raises:
        ShamirError: secret not 32 bytes, threshold < 1 or above the number of indices,
            indices repeated or outside 1..65535.
    """
    if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
        raise ShamirError(f"the secret must be exactly {SECRET_BYTES} bytes")
    xs = list(indices)
    _check_params(threshold, len(xs))
    if len(set(xs)) != len(xs) or not all(
        isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_SHARES for x in xs
    ):
        raise ShamirError(f"share indices must be distinct ints in 1..{MAX_SHARES}")
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    return [Share(index=x, value=_eval_poly(coefficients, x)) for x in xs]


def _check_shares(shares: Sequence[Share]) -> None:
    if not all(isinstance(s, Share) for s in shares):
        raise ShamirError("shares must be Share instances")
    indices = [s.index for s in shares]
    if len(set(indices)) != len(indices):
        raise ShamirError("duplicate share indices")


def interpolate_at_zero(shares: Sequence[Share]) -> int:
    """f(0) of the unique polynomial of degree < len(shares) through the shares (Lagrange)."""
    _check_shares(shares)
    if not shares:
        raise ShamirError("no shares given")
    return _interpolate_at(shares, 0)


def _interpolate_at(shares: Sequence[Share], x: int) -> int:
    total = 0
    for i, si in enumerate(shares):
        num, den = 1, 1
        for j, sj in enumerate(shares):
            if i != j:
                num = num * (x - sj.index) % PRIME
                den = den * (si.index - sj.index) % PRIME
        total = (total + si.value * num * pow(den, -1, PRIME)) % PRIME
    return total


def reconstruct_secret(shares: Sequence[Share], *, threshold: int) -> bytes:
    """Recover the 32-byte secret from at least ``threshold`` distinct shares.

    The first ``threshold`` shares are interpolated; any further shares must lie on the same
    polynomial (a consistency check against corrupted or mixed-up shares).

    Raises:
        ShamirError: fewer than ``threshold`` shares, duplicate indices, inconsistent extra
            shares, or a result that is not a 32-byte secret (shares of something else).
    """
    _check_shares(shares)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ShamirError("threshold must be an int >= 1")
    if len(shares) < threshold:
        raise ShamirError(f"need at least {threshold} shares to reconstruct, got {len(shares)}")
    basis = list(shares[:threshold])
    for extra in shares[threshold:]:
        if _interpolate_at(basis, extra.index) != extra.value:
            raise ShamirError("shares are inconsistent: they do not lie on one polynomial")
    value = interpolate_at_zero(basis)
    if value >= 1 << (8 * SECRET_BYTES):
        raise ShamirError("reconstructed value is not a 32-byte secret (wrong or mixed shares)")
    return value.to_bytes(SECRET_BYTES, "big")


def lagrange_weights_at_zero(indices: Sequence[int]) -> list[int]:
    """λ_i = Π_{j≠i} x_j / (x_j - x_i) (mod p) for distinct x-coordinates, so that
    f(0) = Σ_i λ_i y_i for any polynomial f of degree < len(indices)."""
    if len(set(indices)) != len(indices) or not indices:
        raise ShamirError("need at least one share index, all distinct")
    weights = []
    for i, xi in enumerate(indices):
        num, den = 1, 1
        for j, xj in enumerate(indices):
            if i != j:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        weights.append(num * pow(den, -1, PRIME) % PRIME)
    return weights


#: How many tuples of share indices :func:`reconstruct_many` keeps the Lagrange weights of (a
#: K = 256 round needs one per site; the indices are public x-coordinates, not secrets; at most
#: ≈ 20 MB with t = 170, a full graph's threshold at K = 256).
WEIGHTS_CACHE_SIZE = 1024


@functools.lru_cache(maxsize=WEIGHTS_CACHE_SIZE)
def _cached_weights(indices: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(lagrange_weights_at_zero(indices))


def reconstruct_many(share_sets: Sequence[Sequence[Share]], *, threshold: int) -> list[bytes]:
    """Recover many 32-byte secrets, each from the first ``threshold`` of its shares.

    Same result as :func:`reconstruct_secret` per set, but the Lagrange weights are computed
    once per distinct tuple of share indices (t modular inversions instead of t per secret),
    which is the common case in Unmask, where the same t holders answer for every secret, and
    kept for later calls (:data:`WEIGHTS_CACHE_SIZE` tuples): a site's secrets of every release
    are held by the same neighbours. Extra shares beyond ``threshold`` are ignored (not
    cross-checked).

    Raises:
        ShamirError: a set has fewer than ``threshold`` shares or duplicate indices, or a result
            is not a 32-byte secret.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ShamirError("threshold must be an int >= 1")
    out: list[bytes] = []
    for shares in share_sets:
        _check_shares(shares)
        if len(shares) < threshold:
            raise ShamirError(f"need at least {threshold} shares to reconstruct, got {len(shares)}")
        basis = shares[:threshold]
        weights = _cached_weights(tuple(s.index for s in basis))
        value = sum(w * s.value for w, s in zip(weights, basis, strict=True)) % PRIME
        if value >= 1 << (8 * SECRET_BYTES):
            raise ShamirError("reconstructed value is not a 32-byte secret (wrong or mixed shares)")
        out.append(value.to_bytes(SECRET_BYTES, "big"))
    return out
