"""Vetted CKKS parameters and the CKKS mode's pre-scaling / tolerance rules (docs/protocol.md §4.3).

Every number the CKKS mode relies on lives here, with its justification.

Ring and moduli
---------------
``N = 8192`` (4096 complex slots, each carrying TWO real values: its real and its imaginary
part, "lanes" 2j and 2j+1), coefficient moduli ``[60, 60]``:
one 60-bit *data* prime q0 and one 60-bit *special* prime p. The mode only ADDS ciphertexts
(multiplicative depth 0), so no rescaling primes are needed: a fresh ciphertext lives at the
data level (modulus q0) and every sum stays there. The special prime is kept because SEAL's
public-key encryption encrypts at q0·p and modulus-switches down to q0, dividing the encryption
noise u·e + e1 + e2·s by p ≈ 2^60: what remains is the rounding of that switch (the noise bound
below). Fewer data primes also mean smaller uploads: a ciphertext is 2·N·8 bytes per data prime
(131 KB here vs 393 KB for ``[60, 40, 40, 60]``), with no loss of precision, since the precision
is capped by float64 (53 bits) in SEAL's encoder anyway. Using both parts of every complex slot
(8,192 real lanes per ciphertext instead of 4,096) halves the ciphertexts, the bytes and the
encryption, sum and decryption work per value (16 bytes a value instead of 32); every noise
bound below holds for each part, since it bounds the complex error |e|.

Security (HE standard, homomorphicencryption.org, Albrecht et al. 2018, Table 1, uniform ternary
secret, classical attacks): N = 8192 allows log2(Q·p) <= 218 bits for 128-bit security (152 for
192-bit). Ours is 60 + 60 = 120 <= 152, so the parameters meet the 192-bit level and, a fortiori,
the 128-bit level we state. SEAL itself refuses contexts above its tc128 table.

Slot budget (exact decryption)
------------------------------
A plaintext polynomial m with slot values Δ·z satisfies |m_i| <= Δ·max|z| (inverse canonical
embedding). Decryption is exact iff |m_i + e_i| < q0/2, and q0 > 2^59 (a 60-bit prime), so with
Δ = 2^40 we require every LANE (real or imaginary part) of a SUM to satisfy |x| <= ``SUM_SLOT_BOUND``
= 2^17: then |z| <= √2·2^17 and Δ·|z| <= 2^57.5 < q0/2^1.5, a factor √2 below q0/2 that
absorbs the noise. A release summed over K sites gives each site the budget
``per_site_slot_bound(K)`` = 2^17 / K per lane.

Pre-scaling rule
----------------
A block whose per-site entries satisfy |x| <= B (the bound declared in the plan) is encrypted as
x·s with the power of two s = 2^floor(log2(2^17 / (K·B))) (``choose_prescale``), so the sum
fills between half and all of the slot budget; the decryptor divides by s (exact: a power of
two). The absolute error in data units is then (noise bound in slot units) / s, i.e. about
``noise_bound_slots(K) · 2K·B / 2^17`` relative to the declared K·B: ~2e-12 for K = 8.

Noise bound (derived, not tuned)
--------------------------------
Per fresh ciphertext, in scaled units (Cheon–Kim–Kim–Song, Asiacrypt 2017, Lemma "B_scale",
high-probability canonical-embedding bounds: 6σ for one Gaussian, 16σ for a product of two): the
modulus-switch rounding r0 + r1·s (coefficients uniform in [-1/2, 1/2], secret Hamming weight
h <= N) gives √(N/3)·(3 + 8√h); SEAL's encoder rounding adds another 6·√(N/12) = 3·√(N/3). So

    FRESH_NOISE_BOUND = √(N/3) · (6 + 8·√N)  ≈ 3.8e4        (scaled units; measured max ≈ 9e3)

Sums of K independent encryptions: variances add, so the same high-probability bound is √K times
larger. float64 round-off of the encoder's and decoder's FFTs (Higham, FFT error ~ log2(N)·u·√N
relative to the largest slot, |z| <= √2·2^17; K encodings plus one decoding) adds at most
``FP_SLOT_BOUND`` = 4·log2(N)·2^-53·√N·√2·2^17 slot units. Altogether, in slot units,

    noise_bound_slots(K) = √K · FRESH_NOISE_BOUND / Δ + FP_SLOT_BOUND.

Grid (Li–Micciancio mitigation)
-------------------------------
CKKS decryption results leak information about the secret key (Li & Micciancio, ePrint
2020/1533). The decryptor rounds each decoded value y to y_g = g·round(y/g) for a declared grid
step g >= ``min_grid`` = noise bound in data units; ``default_grid`` is the power of two >= twice
that. The returned value then differs from the exact float64 sum by at most

    error_bound = g/2 + noise_bound_slots(K)/s        (``error_bound``).
"""

from __future__ import annotations

import math

from afl.crypto.errors import CkksConfigError

__all__ = [
    "COEFF_MOD_BIT_SIZES",
    "DATA_MODULUS_BITS",
    "DATA_SLOTS_PER_CIPHERTEXT",
    "FP_SLOT_BOUND",
    "FRESH_NOISE_BOUND",
    "GLOBAL_SCALE",
    "GLOBAL_SCALE_BITS",
    "HE_STANDARD_MAX_LOG_Q_128",
    "LANES_PER_CIPHERTEXT",
    "POLY_MODULUS_DEGREE",
    "SECURITY_LEVEL_BITS",
    "SLOT_COUNT",
    "SUM_SLOT_BOUND",
    "TAG_LANES",
    "TAG_SLOT",
    "choose_prescale",
    "default_grid",
    "error_bound",
    "min_grid",
    "noise_bound_slots",
    "num_ciphertexts",
    "per_site_slot_bound",
]

#: Ring degree N (power of two).
POLY_MODULUS_DEGREE = 8192
#: Bit sizes of the coefficient moduli: one data prime q0, then the special prime p.
COEFF_MOD_BIT_SIZES: tuple[int, ...] = (60, 60)
#: Bits of the data-level modulus q0 (what ciphertexts are stored and summed at).
DATA_MODULUS_BITS = 60
#: Security level of the parameters in bits (HE standard, classical, ternary secret).
SECURITY_LEVEL_BITS = 128
#: HE standard Table 1 (128-bit, classical, uniform ternary secret): max log2(Q) per N.
HE_STANDARD_MAX_LOG_Q_128: dict[int, int] = {
    1024: 27,
    2048: 54,
    4096: 109,
    8192: 218,
    16384: 438,
    32768: 881,
}
#: CKKS scale Δ = 2^40 (slot value z is encoded as round(Δ·z)).
GLOBAL_SCALE_BITS = 40
GLOBAL_SCALE = float(2**GLOBAL_SCALE_BITS)
#: Complex slots per ciphertext (N/2).
SLOT_COUNT = POLY_MODULUS_DEGREE // 2
#: Real lanes per ciphertext: lane 2j is the real part of slot j, lane 2j+1 its imaginary part.
LANES_PER_CIPHERTEXT = 2 * SLOT_COUNT
#: Slot reserved for the aggregate tags in EVERY ciphertext of a block (both of its lanes).
TAG_SLOT = 0
#: Lanes holding the tags (slot ``TAG_SLOT``'s real and imaginary parts).
TAG_LANES = 2
#: Data values per ciphertext (the other lanes).
DATA_SLOTS_PER_CIPHERTEXT = LANES_PER_CIPHERTEXT - TAG_LANES
#: Largest |lane value| of a SUM (module docstring: Δ·√2·2^17 < q0/2^1.5).
SUM_SLOT_BOUND = float(2 ** (DATA_MODULUS_BITS - 3 - GLOBAL_SCALE_BITS))
#: High-probability bound on one fresh ciphertext's slot error, scaled units (module docstring).
FRESH_NOISE_BOUND = math.sqrt(POLY_MODULUS_DEGREE / 3) * (6 + 8 * math.sqrt(POLY_MODULUS_DEGREE))
#: float64 FFT round-off of K encodings + one decoding within the slot budget, slot units.
FP_SLOT_BOUND = (
    4
    * math.log2(POLY_MODULUS_DEGREE)
    * 2.0**-53
    * math.sqrt(POLY_MODULUS_DEGREE)
    * math.sqrt(2.0)
    * SUM_SLOT_BOUND
)

if sum(COEFF_MOD_BIT_SIZES) > HE_STANDARD_MAX_LOG_Q_128[POLY_MODULUS_DEGREE]:  # pragma: no cover
    raise RuntimeError("CKKS parameters exceed the HE-standard 128-bit bound")
if COEFF_MOD_BIT_SIZES[0] != DATA_MODULUS_BITS:  # pragma: no cover
    raise RuntimeError("DATA_MODULUS_BITS must be the first coefficient modulus")


def _check_summands(num_summands: int) -> int:
    if isinstance(num_summands, bool) or not isinstance(num_summands, int):
        raise CkksConfigError(f"num_summands must be an int, got {type(num_summands).__name__}")
    if not 1 <= num_summands <= 2**16:
        raise CkksConfigError(f"num_summands must be in [1, 65536], got {num_summands}")
    return num_summands


def _check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CkksConfigError(f"{name} must be a real number, got {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out) or out <= 0:
        raise CkksConfigError(f"{name} must be finite and > 0, got {value!r}")
    return out


def num_ciphertexts(length: int) -> int:
    """Ciphertexts needed for a block of ``length`` values: ceil(length / 8190), at least 1."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise CkksConfigError(f"length must be a positive int, got {length!r}")
    return -(-length // DATA_SLOTS_PER_CIPHERTEXT)


def per_site_slot_bound(num_summands: int) -> float:
    """Largest |lane value| (pre-scaled data or tag) one of K summands may encrypt: 2^17 / K."""
    return SUM_SLOT_BOUND / _check_summands(num_summands)


def choose_prescale(*, bound: float, num_summands: int) -> float:
    """Pre-scaling factor s = 2^floor(log2(2^17 / (K·B))) for entries |x| <= B (module docstring).

    A power of two, so multiplying and dividing by it is exact in float64.
    """
    b = _check_positive("bound", bound)
    budget = per_site_slot_bound(num_summands) / b
    if not math.isfinite(budget) or not 2.0**-1000 <= budget <= 2.0**1000:
        raise CkksConfigError(f"bound {bound!r} gives an unusable pre-scale")
    exponent = math.frexp(budget)[1]  # budget = m·2^exponent with m in [0.5, 1)
    return math.ldexp(1.0, exponent - 1)


def noise_bound_slots(num_summands: int) -> float:
    """High-probability bound on |decoded - exact| for a sum of K ciphertexts, slot units."""
    k = _check_summands(num_summands)
    return math.sqrt(k) * FRESH_NOISE_BOUND / GLOBAL_SCALE + FP_SLOT_BOUND


def min_grid(*, prescale: float, num_summands: int) -> float:
    """Finest admissible grid step in data units: the noise bound divided by the pre-scale."""
    return noise_bound_slots(num_summands) / _check_positive("prescale", prescale)


def default_grid(*, prescale: float, num_summands: int) -> float:
    """The power of two >= 2·min_grid (rounding then hides the CKKS noise, Li–Micciancio)."""
    target = 2.0 * min_grid(prescale=prescale, num_summands=num_summands)
    return math.ldexp(1.0, math.ceil(math.log2(target)))


def error_bound(*, prescale: float, num_summands: int, grid: float) -> float:
    """Bound on |released value - exact float64 sum|: grid/2 + noise bound / prescale."""
    g = _check_positive("grid", grid)
    return g / 2 + min_grid(prescale=prescale, num_summands=num_summands)
