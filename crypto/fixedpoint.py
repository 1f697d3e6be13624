"""Fixed-point encoding of float64 blocks into the ring Z_{2^64} (docs/protocol.md §5).

A value x with |x| <= B is encoded as q = round(x · 2^f) taken mod 2^64 (numpy uint64, wrapping
arithmetic). A sum of at most K encodings is decoded by reading it as a signed two's-complement
int64 and scaling by 2^-f. Decoding is exact (no wrap-around ambiguity) when

    K · M < 2^63,   M = round(B · 2^f)   (the largest |q|; "K·B·2^f < 2^63" in docs/protocol.md §5),

which the codec checks at construction. Each release block declares its own bound B: Gram
entries grow with N_k·‖h‖², b entries are O(1), and one scale does not fit both.

Error of a decoded sum of K encodings: at most K·2^-(f+1) from rounding each summand, plus the
float64 rounding of the int64 → float64 conversion (relative 2^-53).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from numpy.typing import ArrayLike, NDArray

from afl.crypto.errors import EncodingRangeError, FixedPointConfigError

__all__ = ["RING_HALF", "FixedPointCodec", "choose_frac_bits", "max_encoded_magnitude"]

#: 2^63: encoded sums must stay strictly inside (-2^63, 2^63) to decode unambiguously.
RING_HALF = 1 << 63


def _validate_bound(bound: float) -> None:
    if isinstance(bound, bool) or not isinstance(bound, int | float | np.integer | np.floating):
        raise FixedPointConfigError(f"bound must be a real number, got {type(bound).__name__}")
    try:
        value = float(bound)
    except OverflowError as exc:
        raise FixedPointConfigError("bound is too large for float64") from exc
    if not math.isfinite(value) or value <= 0:
        raise FixedPointConfigError(f"bound must be finite and > 0, got {bound!r}")


def _validate_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise FixedPointConfigError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise FixedPointConfigError(f"{name} must be >= {minimum}, got {value}")


def max_encoded_magnitude(*, bound: float, frac_bits: int) -> int:
    """M = round(B · 2^f), the largest |q| an input with |x| <= B can encode to (exact integer).

    Rounding is half-to-even (numpy.rint), so M = floor(B·2^f + 1/2) is a safe upper bound.
    """
    _validate_bound(bound)
    _validate_count("frac_bits", frac_bits, 0)
    scaled = Fraction(float(bound)) * (1 << int(frac_bits))
    return math.floor(scaled + Fraction(1, 2))


def choose_frac_bits(*, bound: float, max_summands: int) -> int:
    """Largest f >= 0 with K · round(B·2^f) < 2^63: maximal precision for bound B and K summands.

    Raises:
        FixedPointConfigError: even f = 0 overflows (B·K too large for Z_{2^64}).
    """
    _validate_bound(bound)
    _validate_count("max_summands", max_summands, 1)
    k = int(max_summands)
    if k * max_encoded_magnitude(bound=bound, frac_bits=0) >= RING_HALF:
        raise FixedPointConfigError(
            f"bound {bound!r} with {k} summands does not fit Z_2^64 even with 0 fractional bits"
        )
    # Start near the analytic answer log2(2^63 / (K·B)) and correct by exact integer checks.
    f = max(0, math.floor(63 - math.log2(k) - math.log2(bound)) - 2)
    while k * max_encoded_magnitude(bound=bound, frac_bits=f + 1) < RING_HALF:
        f += 1
    while f > 0 and k * max_encoded_magnitude(bound=bound, frac_bits=f) >= RING_HALF:
        f -= 1
    return f


@dataclass(frozen=True)
class FixedPointCodec:
    """Fixed-point codec for one release block: declared bound B, f fractional bits, K summands.

    Construction validates K · round(B·2^f) < 2^63 (docs/protocol.md §5). ``encode`` rejects |x| > B
    and NaN/inf with :class:`EncodingRangeError` (never clips); ``decode`` maps a wrapped uint64 sum
    of at most K encodings back to float64.
    """

    bound: float
    frac_bits: int
    max_summands: int

    def __post_init__(self) -> None:
        _validate_bound(self.bound)
        _validate_count("frac_bits", self.frac_bits, 0)
        _validate_count("max_summands", self.max_summands, 1)
        worst = int(self.max_summands) * max_encoded_magnitude(
            bound=self.bound, frac_bits=self.frac_bits
        )
        if worst >= RING_HALF:
            raise FixedPointConfigError(
                f"K·B·2^f overflows Z_2^64: K={self.max_summands}, B={self.bound!r}, "
                f"f={self.frac_bits} gives {worst} >= 2^63; lower frac_bits "
                f"(at most {self._max_frac_bits_or_none()}) or the bound"
            )

    def _max_frac_bits_or_none(self) -> int | None:
        try:
            return choose_frac_bits(bound=self.bound, max_summands=int(self.max_summands))
        except FixedPointConfigError:
            return None

    @classmethod
    def for_bound(cls, *, bound: float, max_summands: int) -> FixedPointCodec:
        """The codec with the most fractional bits that is valid for bound B and K summands."""
        f = choose_frac_bits(bound=bound, max_summands=max_summands)
        return cls(bound=bound, frac_bits=f, max_summands=max_summands)

    @property
    def resolution(self) -> float:
        """Quantisation step 2^-f."""
        return math.ldexp(1.0, -int(self.frac_bits))

    @property
    def sum_error_bound(self) -> float:
        """Absolute rounding error bound K·2^-(f+1) of a decoded sum (excluding float64 rounding)."""
        return int(self.max_summands) * math.ldexp(1.0, -int(self.frac_bits) - 1)

    def encode(self, x: ArrayLike) -> NDArray[np.uint64]:
        """q = round(x · 2^f) mod 2^64, elementwise; same shape as x.

        Raises:
            EncodingRangeError: some entry is NaN/inf or has |x| > B (the message gives the count
                and the largest magnitude only, never the data).
        """
        arr = np.asarray(x)
        if arr.dtype.kind not in "biuf":
            raise EncodingRangeError(f"expected a real numeric array, got dtype {arr.dtype}")
        values = arr.astype(np.float64, copy=False)
        finite = np.isfinite(values)
        if not bool(finite.all()):
            raise EncodingRangeError(
                f"{int(values.size - np.count_nonzero(finite))} entries are NaN or inf; "
                "refusing to encode"
            )
        if values.size:
            peak = float(np.max(np.abs(values)))
            if peak > self.bound:
                over = int(np.count_nonzero(np.abs(values) > self.bound))
                raise EncodingRangeError(
                    f"{over} entries exceed the declared bound {self.bound!r} "
                    f"(max |x| = {peak:.6g}); values are never clipped"
                )
        q = np.rint(np.ldexp(values, int(self.frac_bits)))
        return q.astype(np.int64).view(np.uint64)

    def decode(self, encoded_sum: ArrayLike) -> NDArray[np.float64]:
        """x = int64(s) · 2^-f for a uint64 sum s of at most K encodings (two's complement)."""
        arr = np.asarray(encoded_sum)
        if arr.dtype != np.uint64:
            raise EncodingRangeError(f"decode expects a uint64 array, got dtype {arr.dtype}")
        signed = np.ascontiguousarray(arr).view(np.int64)
        return np.ldexp(signed.astype(np.float64), -int(self.frac_bits))
