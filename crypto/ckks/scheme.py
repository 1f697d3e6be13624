"""CKKS mode core: contexts, encryption with aggregate tags, sums (docs/protocol.md §4.3).

Roles:
    decryptor  ``create_private_context()``; publishes ``public_context_bytes(ctx)`` (public key
               only: no secret key, no Galois or relinearization keys, since only additions are
               needed); decrypts with :mod:`afl.crypto.ckks.decrypt`.
    client     ``load_public_context(bytes)``; ``tag = new_tag(num_summands=K)`` (sent to the
               decryptor over an encrypted channel); ``encrypt_block(...)`` → ciphertexts.
    server     ``load_public_context(bytes)`` (``ensure_public``: a server holding a private
               context must refuse to start); ``sum_ciphertexts(...)`` per release.

Block layout: a float64 vector x (e.g. the packed Gram upper triangle, 524,800 values for
d = 1024) is pre-scaled by the power of two s declared in the plan
(:func:`afl.crypto.ckks.params.choose_prescale`) and cut into ceil(len/8190) ciphertexts of
4,096 complex slots. Each slot carries two real values ("lanes": lane 2j is slot j's real part,
lane 2j+1 its imaginary part; :mod:`afl.crypto.ckks.params`). Both lanes of slot ``TAG_SLOT`` (0)
of ciphertext i hold block tags, r_{k,2i} and r_{k,2i+1} = ``block_tag(r_k, 2i)`` and
``block_tag(r_k, 2i + 1)`` (r_k itself in lane 0 of ciphertext 0, values derived from r_k and
the lane's index elsewhere); lanes 2..8191 hold x·s, the last ciphertext padded with zeros. The
sum over a release's members then carries Σ_k r_{k,j} in tag lane j, which the decryptor checks
before releasing anything; since each tag is bound to its position, a server that puts one
upload's block where another belongs (to difference one site's blocks), or turns a ciphertext's
lanes into each other (multiplying by the monomial X^{N/2} multiplies every slot by i), fails the
check. All values must satisfy |x·s| <= 2^17/K and |r_k| <= 2^17/K (``per_site_slot_bound``):
out-of-range inputs are rejected, never clipped.

Encryption goes through SEAL's own encoder and encryptor (``tenseal.sealapi``: TenSEAL's vectors
encode real slots only) and each ciphertext travels as a serialized TenSEAL ckks_vector of 4,096
slots (:func:`vector_bytes`), so the server parses, checks and adds TenSEAL vectors as before.

Wire format of a ciphertext list (``DTYPE_CKKS_VECTORS`` in common.proto): records of
(uint32 little-endian byte length, serialized TenSEAL ckks_vector), see ``pack_ciphertexts``.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import struct
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from afl.crypto.ckks import params as cp
from afl.crypto.errors import CkksContextError, CkksMalformedError, CkksRangeError

__all__ = [
    "block_tag",
    "check_ciphertexts",
    "check_parameters",
    "context_fingerprint",
    "create_private_context",
    "decode_lanes",
    "deserialize_ciphertexts",
    "encrypt_block",
    "encrypt_block_bytes",
    "ensure_private",
    "ensure_public",
    "load_private_context",
    "load_public_context",
    "new_tag",
    "pack_ciphertexts",
    "private_context_bytes",
    "public_context_bytes",
    "serialize_ciphertexts",
    "sum_ciphertexts",
    "unpack_ciphertexts",
    "vector_bytes",
]

#: Largest serialized ciphertext accepted (a [60]-level ciphertext is ~131 KB).
MAX_CIPHERTEXT_BYTES = 1 << 20
_RECORD = struct.Struct("<I")


def _tenseal() -> Any:
    """TenSEAL, imported on first use: importing this module (as every coordinator and site
    daemon does) loads no TenSEAL, so only a CKKS federation's processes pay for it."""
    import tenseal
    import tenseal.sealapi  # registers SEAL's types (e.g. Modulus) with pybind for check_parameters

    return tenseal


def _sealapi() -> Any:
    """SEAL's Python API as TenSEAL ships it (the complex encoder and the raw encryptor)."""
    _tenseal()
    import tenseal.sealapi

    return tenseal.sealapi


class _SealFile:
    """A file in memory through which SEAL objects are saved (TenSEAL's ``sealapi`` saves to a
    path only): a memfd where the platform has one, else a file in a private temporary folder."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
            self._fd = os.memfd_create("afl-ckks", os.MFD_CLOEXEC)
            self.path = f"/proc/self/fd/{self._fd}"
        else:  # pragma: no cover - platforms without memfd
            self._dir = tempfile.TemporaryDirectory(prefix="afl-ckks-")
            self.path = os.path.join(self._dir.name, "object")

    def save(self, obj: Any) -> bytes:
        """SEAL's serialization of ``obj``."""
        obj.save(self.path)
        if self._fd is None:  # pragma: no cover
            with open(self.path, "rb") as handle:
                return handle.read()
        size, parts, pos = os.fstat(self._fd).st_size, [], 0
        while pos < size:
            part = os.pread(self._fd, size - pos, pos)
            if not part:
                break
            parts.append(part)
            pos += len(part)
        return b"".join(parts)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        if self._dir is not None:  # pragma: no cover
            self._dir.cleanup()


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def vector_bytes(seal_ciphertext: bytes, *, size: int, scale: float) -> bytes:
    """A serialized TenSEAL ckks_vector (its ``CKKSVectorProto``: field 1 the slot count, field
    2 the SEAL ciphertext, field 3 the scale) holding one SEAL ciphertext; what
    ``CKKSVector.serialize`` writes for a vector of ``size`` slots, parsed by ``CKKSVector.load``."""
    count = _varint(size)
    return b"".join(
        (
            b"\x0a" + _varint(len(count)) + count,
            b"\x12" + _varint(len(seal_ciphertext)) + seal_ciphertext,
            b"\x19" + struct.pack("<d", scale),
        )
    )


def create_private_context(*, n_threads: int | None = None) -> Any:
    """New ASYMMETRIC (public-key) CKKS context with the vetted parameters; holds the secret key.

    Only the decryptor site calls this. Its secret key never leaves it (see
    ``public_context_bytes``).
    """
    ts = _tenseal()
    ctx = ts.context(
        ts.SCHEME_TYPE.CKKS,
        poly_modulus_degree=cp.POLY_MODULUS_DEGREE,
        coeff_mod_bit_sizes=list(cp.COEFF_MOD_BIT_SIZES),
        encryption_type=ts.ENCRYPTION_TYPE.ASYMMETRIC,
        n_threads=n_threads,
    )
    ctx.global_scale = cp.GLOBAL_SCALE
    check_parameters(ctx)
    ensure_private(ctx)
    return ctx


def check_parameters(ctx: Any) -> None:
    """Raise ``CkksContextError`` unless ``ctx`` is a CKKS context with the vetted N and moduli
    and a public key (a context from elsewhere might be weaker or lack public-key encryption)."""
    ts = _tenseal()
    if not isinstance(ctx, ts.Context):
        raise CkksContextError(f"expected a tenseal.Context, got {type(ctx).__name__}")
    seal_ctx = ctx.seal_context().data
    if not seal_ctx.parameters_set():
        raise CkksContextError("the CKKS context's parameters are not valid for SEAL")
    key_parms = seal_ctx.key_context_data().parms()
    bits = tuple(int(m.bit_count()) for m in key_parms.coeff_modulus())
    degree = int(key_parms.poly_modulus_degree())
    if key_parms.scheme() != ts._ts_cpp.SCHEME_TYPE.CKKS:
        raise CkksContextError("the context is not a CKKS context")
    if degree != cp.POLY_MODULUS_DEGREE or bits != cp.COEFF_MOD_BIT_SIZES:
        raise CkksContextError(
            f"CKKS parameters N={degree}, moduli bits={list(bits)} differ from the vetted "
            f"N={cp.POLY_MODULUS_DEGREE}, moduli bits={list(cp.COEFF_MOD_BIT_SIZES)}"
        )
    try:
        has_public_key = bool(ctx.has_public_key())
    except ValueError:  # TenSEAL raises for symmetric contexts
        has_public_key = False
    if not has_public_key:
        raise CkksContextError("the CKKS context has no public key (symmetric context?)")


def ensure_public(ctx: Any) -> None:
    """Raise ``CkksContextError`` if ``ctx`` holds a secret key (servers and clients must not)."""
    check_parameters(ctx)
    if ctx.is_private() or ctx.has_secret_key():
        raise CkksContextError(
            "this CKKS context holds a secret key: only the decryptor may hold it; refusing to "
            "use it (a server with a private context must not start)"
        )


def ensure_private(ctx: Any) -> None:
    """Raise ``CkksContextError`` unless ``ctx`` holds the secret key (the decryptor's context)."""
    check_parameters(ctx)
    if not ctx.is_private():
        raise CkksContextError("this CKKS context has no secret key: it cannot decrypt")


def public_context_bytes(ctx: Any) -> bytes:
    """Serialize ``ctx`` WITHOUT secret, Galois and relinearization keys (public key only).

    The output is re-loaded and checked with ``load_public_context`` before it is returned.
    """
    check_parameters(ctx)
    data = bytes(
        ctx.serialize(
            save_public_key=True,
            save_secret_key=False,
            save_galois_keys=False,
            save_relin_keys=False,
        )
    )
    load_public_context(data)
    return data


def private_context_bytes(ctx: Any) -> bytes:
    """Serialize the decryptor's context WITH its secret key (for the decryptor's own disk only)."""
    ensure_private(ctx)
    return bytes(
        ctx.serialize(
            save_public_key=True,
            save_secret_key=True,
            save_galois_keys=False,
            save_relin_keys=False,
        )
    )


def _load_context(data: bytes) -> Any:
    if not isinstance(data, bytes) or not data:
        raise CkksContextError("a serialized CKKS context must be non-empty bytes")
    try:
        ctx = _tenseal().context_from(data)
    except (ValueError, RuntimeError, TypeError) as exc:
        raise CkksContextError("bytes are not a serialized TenSEAL context") from exc
    check_parameters(ctx)
    ctx.global_scale = cp.GLOBAL_SCALE
    return ctx


def load_public_context(data: bytes) -> Any:
    """Load a context for clients and the server; REJECTS any context holding a secret key."""
    ctx = _load_context(data)
    ensure_public(ctx)
    return ctx


def load_private_context(data: bytes) -> Any:
    """Load the decryptor's own context (``private_context_bytes``); requires the secret key."""
    ctx = _load_context(data)
    ensure_private(ctx)
    return ctx


def context_fingerprint(data: bytes) -> bytes:
    """SHA-256 of serialized context bytes (``CkksContextAnnouncement.context_sha256``)."""
    return hashlib.sha256(data).digest()


def new_tag(*, num_summands: int) -> float:
    """Secret aggregate tag r_k, uniform on [-2^17/K, 2^17/K] with 52 random bits (``secrets``).

    A server combination Σ a_k·c_k with integer a ≠ (1, ..., 1) passes the decryptor's check only
    if |Σ (a_k - 1)·r_k| <= noise bound, which has probability <= noise bound / (2^17/K) (< 1e-11
    for K = 8; ``ckks_params.noise_bound_slots``).
    """
    bound = cp.per_site_slot_bound(num_summands)
    unit = secrets.randbits(52) / float(1 << 52)  # in [0, 1)
    return bound * (2.0 * unit - 1.0)


_BLOCK_TAG_DOMAIN = b"afl-secagg/1 ckks-block-tag"


def block_tag(tag: float, index: int) -> float:
    """The tag slot of block ``index`` of an upload whose secret tag is ``tag``: ``tag`` for block
    0, and for block i > 0 the value |tag|·(2u - 1), u in [0, 1) from 52 bits of SHA-256(domain,
    tag's 8 bytes, i). Unpredictable without ``tag`` and never larger than it, so a block moved to
    another position passes the decryptor's check with probability <= noise bound / |tag|."""
    if index == 0:
        return float(tag)
    digest = hashlib.sha256(_BLOCK_TAG_DOMAIN + struct.pack("<dQ", float(tag), int(index))).digest()
    unit = (int.from_bytes(digest[:8], "little") >> 12) / float(1 << 52)
    return abs(float(tag)) * (2.0 * unit - 1.0)


def _checked_lanes(values: ArrayLike, *, prescale: float, num_summands: int, tag: float) -> Any:
    """The lanes of every ciphertext of the block (module docstring), after the range checks."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise CkksRangeError(f"values must be a non-empty 1-D vector, got shape {x.shape}")
    s = float(prescale)
    if not math.isfinite(s) or s <= 0:
        raise CkksRangeError(f"prescale must be finite and > 0, got {prescale!r}")
    bound = cp.per_site_slot_bound(num_summands)
    scaled = x * s
    if not np.all(np.isfinite(scaled)):
        raise CkksRangeError("values contain NaN or inf (or overflow when pre-scaled)")
    peak = float(np.max(np.abs(scaled)))
    if peak > bound:
        raise CkksRangeError(
            f"pre-scaled values reach {peak:.6g} > slot bound {bound:.6g} = 2^17/{num_summands}: "
            "the declared bound is too small for these values"
        )
    t = float(tag)
    if not math.isfinite(t) or abs(t) > bound:
        raise CkksRangeError(f"tag must be finite with |tag| <= {bound:.6g}")
    count = cp.num_ciphertexts(int(x.size))
    data = np.zeros(count * cp.DATA_SLOTS_PER_CIPHERTEXT, dtype=np.float64)
    data[: x.size] = scaled
    lanes = np.empty((count, cp.LANES_PER_CIPHERTEXT), dtype=np.float64)
    lanes[:, cp.TAG_LANES :] = data.reshape(count, cp.DATA_SLOTS_PER_CIPHERTEXT)
    for i in range(count):
        for lane in range(cp.TAG_LANES):
            lanes[i, lane] = block_tag(t, cp.TAG_LANES * i + lane)
    return lanes


def encrypt_block_bytes(
    ctx: Any,
    values: ArrayLike,
    *,
    prescale: float,
    num_summands: int,
    tag: float,
    zeros: Callable[[], Any | None] | None = None,
) -> list[bytes]:
    """Encrypt x·s in ceil(len/8190) ciphertexts of two lanes a slot, with the block tags in
    slot 0 (module docstring); each returned as a serialized TenSEAL ckks_vector (what a site
    uploads, :func:`pack_ciphertexts`).

    ``num_summands`` is the largest member count of the releases this upload enters; values must
    satisfy |x·s| <= 2^17/K and the tag |r| <= 2^17/K (``CkksRangeError`` otherwise).
    ``zeros``: a source of fresh encryptions of zero under ``ctx``'s public key, each handed out
    once (:class:`afl.crypto.ckks.zeros.ZeroPool`); a ciphertext is then that encryption plus the
    encoded plaintext, which is what SEAL's ``encrypt`` computes. When it returns None the
    ciphertext is encrypted on the spot.
    """
    check_parameters(ctx)
    lanes = _checked_lanes(values, prescale=prescale, num_summands=num_summands, tag=tag)
    slots = lanes[:, 0::2] + 1j * lanes[:, 1::2]
    seal = _sealapi()
    seal_ctx = ctx.seal_context().data
    encoder = seal.CKKSEncoder(seal_ctx)
    encryptor = seal.Encryptor(seal_ctx, ctx.public_key().data)
    evaluator: Any = None
    memory = _SealFile()
    out: list[bytes] = []
    try:
        for row in slots:
            plain = seal.Plaintext()
            encoder.encode(row.tolist(), cp.GLOBAL_SCALE, plain)
            cipher = zeros() if zeros is not None else None
            if cipher is None:
                cipher = seal.Ciphertext(seal_ctx)
                encryptor.encrypt(plain, cipher)
            else:  # c0 += m: Encryptor::encrypt's own last step
                evaluator = evaluator or seal.Evaluator(seal_ctx)
                evaluator.add_plain_inplace(cipher, plain)
            out.append(vector_bytes(memory.save(cipher), size=cp.SLOT_COUNT, scale=cp.GLOBAL_SCALE))
    finally:
        memory.close()
    return out


def encrypt_block(
    ctx: Any, values: ArrayLike, *, prescale: float, num_summands: int, tag: float
) -> list[Any]:
    """:func:`encrypt_block_bytes` as TenSEAL CKKS vectors (linked to ``ctx``)."""
    blobs = encrypt_block_bytes(ctx, values, prescale=prescale, num_summands=num_summands, tag=tag)
    ts = _tenseal()
    return [ts.CKKSVector.load(ctx, blob) for blob in blobs]


def decode_lanes(ctx_private: Any, vector: Any) -> Any:
    """Decrypt one ciphertext with the secret key of ``ctx_private`` and return its 8,192 lanes
    (float64; lane 2j the real part of slot j, lane 2j+1 its imaginary part)."""
    seal = _sealapi()
    seal_ctx = ctx_private.seal_context().data
    plain = seal.Plaintext()
    seal.Decryptor(seal_ctx, ctx_private.secret_key().data).decrypt(vector.ciphertext()[0], plain)
    slots = np.asarray(seal.CKKSEncoder(seal_ctx).decode_complex(plain), dtype=np.complex128)
    lanes = np.empty(cp.LANES_PER_CIPHERTEXT, dtype=np.float64)
    lanes[0::2], lanes[1::2] = slots.real, slots.imag
    return lanes


def check_ciphertexts(vectors: Sequence[Any], *, length: int) -> None:
    """Raise ``CkksMalformedError`` unless ``vectors`` is the layout of a block of ``length``
    values: right count, 4,096 slots each, one 2-polynomial ciphertext each, NOT transparent, at the data
    level and at exactly scale Δ (a rescaled or plaintext-multiplied ciphertext fails)."""
    ts = _tenseal()
    count, size = cp.num_ciphertexts(length), cp.SLOT_COUNT
    if len(vectors) != count:
        raise CkksMalformedError(f"expected {count} ciphertexts, got {len(vectors)}")
    for i, vec in enumerate(vectors):
        if not isinstance(vec, ts.CKKSVector) or vec.size() != size:
            raise CkksMalformedError(f"ciphertext {i} is not a CKKS vector of {size} slots")
        cts = vec.ciphertext()
        first = vec.context().seal_context().data.first_parms_id()
        if len(cts) != 1:
            raise CkksMalformedError(f"ciphertext {i} holds {len(cts)} SEAL ciphertexts, not 1")
        ct = cts[0]
        if ct.size() != 2 or ct.is_transparent() or not ct.is_ntt_form():
            raise CkksMalformedError(f"ciphertext {i} is not a fresh-shaped 2-part ciphertext")
        if ct.parms_id() != first or ct.scale != cp.GLOBAL_SCALE:
            raise CkksMalformedError(f"ciphertext {i} is not at the data level with scale 2^40")


def serialize_ciphertexts(vectors: Sequence[Any]) -> list[bytes]:
    """One serialized ckks_vector per ciphertext (stream them one message each)."""
    return [bytes(v.serialize()) for v in vectors]


def deserialize_ciphertexts(ctx: Any, blobs: Sequence[bytes], *, length: int) -> list[Any]:
    """Parse untrusted ciphertext bytes against ``ctx`` and check the layout (``check_ciphertexts``)."""
    check_parameters(ctx)
    out: list[Any] = []
    for i, blob in enumerate(blobs):
        if not isinstance(blob, bytes) or not 0 < len(blob) <= MAX_CIPHERTEXT_BYTES:
            raise CkksMalformedError(f"ciphertext {i} must be 1..{MAX_CIPHERTEXT_BYTES} bytes")
        try:
            out.append(_tenseal().CKKSVector.load(ctx, blob))
        except (ValueError, RuntimeError, TypeError) as exc:
            raise CkksMalformedError(f"ciphertext {i} does not parse") from exc
    check_ciphertexts(out, length=length)
    return out


def pack_ciphertexts(blobs: Sequence[bytes]) -> bytes:
    """Concatenate records (uint32 LE length, bytes): ``DTYPE_CKKS_VECTORS`` of common.proto."""
    parts: list[bytes] = []
    for blob in blobs:
        if not 0 < len(blob) <= MAX_CIPHERTEXT_BYTES:
            raise CkksMalformedError(f"a ciphertext must be 1..{MAX_CIPHERTEXT_BYTES} bytes")
        parts += [_RECORD.pack(len(blob)), blob]
    return b"".join(parts)


def unpack_ciphertexts(data: bytes) -> list[bytes]:
    """Inverse of ``pack_ciphertexts``; rejects truncated or oversize records."""
    out: list[bytes] = []
    view, pos = memoryview(data), 0
    while pos < len(view):
        if pos + _RECORD.size > len(view):
            raise CkksMalformedError("truncated record header in packed ciphertexts")
        (size,) = _RECORD.unpack_from(view, pos)
        pos += _RECORD.size
        if not 0 < size <= MAX_CIPHERTEXT_BYTES or pos + size > len(view):
            raise CkksMalformedError("bad record length in packed ciphertexts")
        out.append(bytes(view[pos : pos + size]))
        pos += size
    return out


def sum_ciphertexts(ctx_public: Any, uploads: Sequence[Sequence[Any]], *, length: int) -> list[Any]:
    """Server side: slot-wise homomorphic sum Σ_k c_k of the members' ciphertext lists.

    Needs only the public context (``ensure_public``); every upload must have the layout of a
    block of ``length`` values. Returns new ciphertexts (inputs are not modified).
    """
    ensure_public(ctx_public)
    if not uploads:
        raise CkksMalformedError("nothing to sum: no uploads")
    for upload in uploads:
        check_ciphertexts(upload, length=length)
        if upload[0].context().is_private():
            raise CkksContextError("a ciphertext is linked to a private context on the server")
    if len(uploads) == 1:
        return [v.copy() for v in uploads[0]]  # TenSEAL's copy is slow; a sum of one is rare
    total = [a.add(b) for a, b in zip(uploads[0], uploads[1], strict=True)]  # new objects
    for upload in uploads[2:]:
        for acc, vec in zip(total, upload, strict=True):
            acc.add_(vec)
    return total
