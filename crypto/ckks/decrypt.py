"""CKKS decryptor side: tag-checked, grid-rounded, release-once decryption (docs/protocol.md §4.3).

``decrypt_release`` decrypts the homomorphic sum of a release's members and, BEFORE returning
anything, checks that each tag lane j (the real and imaginary parts of slot 0 of ciphertext i,
j = 2i and 2i + 1) equals Σ_{k ∈ members} r_{k,j} within the derived bound
``noise_bound_slots(K)`` (:mod:`afl.crypto.ckks.params`; r_{k,j} =
:func:`afl.crypto.ckks.scheme.block_tag` of member k's tag r_k). A server that forwards one site's
ciphertext (tag r_1) as a 3-site sum, sums another member set, re-weights the uploads
(Σ a_k·c_k, a ≠ 1) or moves a block of an upload to another position is refused. The decoded data slots are divided by the declared
pre-scale s and rounded to the declared grid g (y ↦ g·round(y/g), Li–Micciancio mitigation,
ePrint 2020/1533); g must be at least the noise bound in data units, so the rounding covers the
CKKS noise. The result differs from the exact float64 sum by at most
``error_bound = g/2 + noise_bound_slots(K)/s``.

``Decryptor`` keeps the round's state: the signed plan's releases (passed in as data; the CALLER
verifies the plan's signature), the members' tags (received over the encrypted channel; the
CALLER verifies each sender's signature, :func:`afl.crypto.ckks.wire.open_tags`), and the
releases already decrypted. A release is decrypted for at most ONE aggregate: it is bound to the
SHA-256 of the packed ciphertexts (:func:`afl.crypto.ckks.scheme.pack_ciphertexts`) before the secret
key is applied, even if the tag check then refuses it (no second attempt for a server that
failed one). The same ciphertexts again are decrypted again: CKKS decryption is deterministic,
so a retry (a lost reply, a restarted coordinator) returns exactly what was already returned and
reveals nothing new, while any other aggregate under that name (a second member combination to
difference against the first) is refused. The caller makes the binding durable: ``decrypted``
restores the (release → digest) bindings of an earlier process, and ``on_decrypt(name, digest)``
runs after the release is bound and BEFORE the secret key is applied (it persists the record; if
it raises, nothing is decrypted).
Requests with a wrong release name, member list, a member without a tag, or malformed
ciphertexts are refused before the secret key is used and do not consume the release.

Not covered: the tag check is no proof against every homomorphic manipulation, and TenSEAL has no
threshold decryption; the mode assumes the decryptor and the server do not collude
(docs/protocol.md §4.3).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.crypto.ckks import params as cp
from afl.crypto.ckks.scheme import (
    block_tag,
    check_ciphertexts,
    decode_lanes,
    deserialize_ciphertexts,
    ensure_private,
    pack_ciphertexts,
)
from afl.crypto.errors import (
    CkksAlreadyDecryptedError,
    CkksConfigError,
    CkksMalformedError,
    CkksNotInPlanError,
    CkksTagMismatchError,
)

__all__ = ["CkksRelease", "Decryptor", "decrypt_release"]


def _as_vectors(ctx_private: Any, summed: Sequence[Any], length: int) -> list[Any]:
    if summed and all(isinstance(item, bytes) for item in summed):
        return deserialize_ciphertexts(ctx_private, summed, length=length)
    vectors = list(summed)
    check_ciphertexts(vectors, length=length)
    return vectors


def _digest(summed: Sequence[Any]) -> bytes:
    """SHA-256 of the packed ciphertexts (serialized first when given as vectors)."""
    blobs = [item if isinstance(item, bytes) else item.serialize() for item in summed]
    return hashlib.sha256(pack_ciphertexts(blobs)).digest()


def _check_grid(*, grid: float, prescale: float, num_summands: int) -> float:
    finest = cp.min_grid(prescale=prescale, num_summands=num_summands)
    g = float(grid)
    if not math.isfinite(g) or g < finest:
        raise CkksConfigError(
            f"grid step {grid!r} is finer than the CKKS noise bound {finest:.3g}: rounding would "
            "not hide the noise (Li–Micciancio)"
        )
    return g


def decrypt_release(
    ctx_private: Any,
    summed: Sequence[Any],
    *,
    member_tags: Sequence[float],
    length: int,
    prescale: float,
    num_summands: int,
    grid: float,
) -> NDArray[np.float64]:
    """Decrypt a K-member sum; refuse unless tag lane j (lanes 0 and 1 of block i: j = 2i, 2i + 1)
    equals Σ_k block_tag(r_k, j) over ``member_tags`` (the members' secret tags r_k).

    ``summed``: ciphertexts (CKKS vectors or their serialized bytes) in the layout of
    :func:`afl.crypto.ckks.scheme.encrypt_block` for ``length`` values. Returns g·round(y/(s·g)) per
    value. Raises ``CkksTagMismatchError`` (nothing is returned), ``CkksMalformedError`` (bad
    layout, or decoded values beyond the slot budget) or ``CkksConfigError`` (grid too fine).
    """
    ensure_private(ctx_private)
    g = _check_grid(grid=grid, prescale=prescale, num_summands=num_summands)
    tags = [float(r) for r in member_tags]
    if not tags or not all(math.isfinite(r) for r in tags):
        raise CkksConfigError("member_tags must be finite, one per member")
    vectors = _as_vectors(ctx_private, summed, length)
    tolerance = cp.noise_bound_slots(num_summands)
    decoded = [decode_lanes(ctx_private, v) for v in vectors]
    for i, y in enumerate(decoded):
        for lane in range(cp.TAG_LANES):
            expected = math.fsum(block_tag(r, cp.TAG_LANES * i + lane) for r in tags)
            if not abs(float(y[lane]) - expected) <= tolerance:
                raise CkksTagMismatchError(
                    f"tag lane {lane} of ciphertext {i} does not equal the sum of the members' "
                    "tags: the ciphertext is not the sum of exactly the plan's members; refusing "
                    "to release it"
                )
    data = np.concatenate([y[cp.TAG_LANES :] for y in decoded])[:length]
    if data.size != length or not np.all(np.abs(data) <= cp.SUM_SLOT_BOUND + tolerance):
        raise CkksMalformedError("decoded values exceed the slot budget: refusing to release")
    return np.asarray(np.round(data / prescale / g) * g, dtype=np.float64)


@dataclass(frozen=True)
class CkksRelease:
    """One release of the signed plan as the decryptor needs it (``Release`` in common.proto).

    ``members``: sorted unique site ids; ``upload_name``: the upload slot whose ciphertexts are
    summed (its tags are registered under that name); ``length``: number of values;
    ``prescale``/``grid``: the plan's ``CkksEncoding`` (grid >= ``ckks_params.min_grid``).
    """

    name: str
    members: tuple[str, ...]
    upload_name: str
    length: int
    prescale: float
    grid: float

    def __post_init__(self) -> None:
        if not self.name or not self.upload_name:
            raise CkksConfigError("release and upload names must be non-empty")
        if not self.members or list(self.members) != sorted(set(self.members)):
            raise CkksConfigError(f"release {self.name!r}: members must be sorted, unique, >= 1")
        cp.num_ciphertexts(self.length)
        _check_grid(grid=self.grid, prescale=self.prescale, num_summands=len(self.members))

    @property
    def num_summands(self) -> int:
        """K = number of members."""
        return len(self.members)


class Decryptor:
    """The decryptor site's state for one round: plan, tags, releases already decrypted."""

    def __init__(
        self,
        ctx_private: Any,
        releases: Iterable[CkksRelease],
        *,
        decrypted: Mapping[str, bytes] | None = None,
        on_decrypt: Callable[[str, bytes], None] | None = None,
    ) -> None:
        ensure_private(ctx_private)
        self._ctx = ctx_private
        self._plan: dict[str, CkksRelease] = {}
        for release in releases:
            if release.name in self._plan:
                raise CkksConfigError(f"release {release.name!r} appears twice in the plan")
            self._plan[release.name] = release
        self._tags: dict[tuple[str, str], float] = {}
        self._used: dict[str, bytes] = dict(decrypted or {})
        self._recorded: set[str] = set(self._used)  # bindings ``on_decrypt`` made durable
        self._on_decrypt = on_decrypt

    @property
    def decrypted(self) -> frozenset[str]:
        """Releases whose decryption was attempted with the secret key (bound to one aggregate)."""
        return frozenset(self._used)

    def register_tags(self, *, site: str, tags: Mapping[str, float]) -> None:
        """Record ``site``'s secret tag per upload slot (``AggregateTags`` message).

        The site must be a member of a planned release of each upload slot; re-sending the same
        value is accepted, a different value is refused (``CkksConfigError``).
        """
        for upload, value in tags.items():
            if not any(site in r.members and r.upload_name == upload for r in self._plan.values()):
                raise CkksNotInPlanError(f"site {site!r} is in no planned release of {upload!r}")
            tag = float(value)
            if not math.isfinite(tag):
                raise CkksConfigError("tags must be finite")
            key = (site, upload)
            if key in self._tags and self._tags[key] != tag:
                raise CkksConfigError(f"site {site!r} already sent another tag for {upload!r}")
            self._tags[key] = tag

    def decrypt(
        self, release_name: str, summed: Sequence[Any], *, members: Sequence[str]
    ) -> NDArray[np.float64]:
        """Decrypt a planned release, for one aggregate only (``DecryptionJob``); see the module
        docstring."""
        release = self._plan.get(release_name)
        if release is None:
            raise CkksNotInPlanError(f"release {release_name!r} is not in the signed plan")
        if tuple(sorted(members)) != release.members or len(set(members)) != len(members):
            raise CkksNotInPlanError(f"release {release_name!r}: members differ from the plan")
        missing = [m for m in release.members if (m, release.upload_name) not in self._tags]
        if missing:
            raise CkksTagMismatchError(
                f"release {release_name!r}: no valid tag from {missing}; refusing to release it"
            )
        vectors = _as_vectors(self._ctx, summed, release.length)
        digest = _digest(summed)
        bound = self._used.get(release_name)
        if bound is not None and bound != digest:
            raise CkksAlreadyDecryptedError(
                f"release {release_name!r} was already decrypted for another aggregate"
            )
        tags = [self._tags[(m, release.upload_name)] for m in release.members]
        self._used[release_name] = digest
        if self._on_decrypt is not None and release_name not in self._recorded:
            self._on_decrypt(release_name, digest)
        self._recorded.add(release_name)
        return decrypt_release(
            self._ctx,
            vectors,
            member_tags=tags,
            length=release.length,
            prescale=release.prescale,
            num_summands=release.num_summands,
            grid=release.grid,
        )
