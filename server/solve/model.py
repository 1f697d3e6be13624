"""The server's solve from released sums, and the signed model (paper eq. 13-15, 20-22).

Round 1: :func:`afl.core.aggregation.solve_from_sums` with the Gram sum of each release and the
class vector sums b_c (eq. 15; ``global`` scope: one Gram for every class). Round 2:
:func:`afl.core.refinement.solve_round2` with the round-1 global Gram ``gram[all]``, the round-1
b_c and the round-2 pseudo-label sums (eq. 20-22). Classes without a b release keep w_c = 0.

The model is a ``Model`` message (W as dense little-endian float64 [d, C], class names, round id,
contributors, plan digest) serialized once and signed by the server identity key over those
exact bytes (context "model"; :mod:`afl.crypto.identity.signed_blobs`).

No value crashes the coordinator: :func:`require_finite` checks every released sum before the
solve (two finite uploads can overflow to ±inf when summed) and W after it, and
:data:`SOLVE_ERRORS` is every failure a solve can raise from its data (shapes, non-finite values,
an indefinite Σ G + γI: :class:`~afl.core.aggregation.AggregationError`, scipy's ValueError and
LinAlgError, arithmetic errors, a stored payload that no longer matches its digest). The round
machine aborts the round with the reason instead (docs/protocol.md §9).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from numpy.typing import NDArray

from afl.core.aggregation import (
    AggregationError,
    AggregationPlan,
    Cover,
    GramScope,
    solve_from_sums,
)
from afl.core.refinement import solve_round2
from afl.crypto.identity.signed_blobs import MODEL_CONTEXT, blob_sha256, sign_blob
from afl.proto.v1 import common_pb2, coordinator_pb2
from afl.server.errors import StateError
from afl.server.plan.release import GLOBAL_GRAM, PlannedRelease

__all__ = [
    "SOLVE_ERRORS",
    "b_matrix",
    "build_signed_model",
    "require_finite",
    "solve_round_one",
    "solve_round_two",
]

#: What a solve may raise from its data (module docstring); ValueError covers AggregationError,
#: scipy's and numpy's LinAlgError and the decoders' InvalidRequestError.
SOLVE_ERRORS: tuple[type[Exception], ...] = (ValueError, ArithmeticError, StateError)


def require_finite(arrays: Mapping[str, NDArray[np.float64]], *, what: str) -> None:
    """:class:`AggregationError` naming the first of ``arrays`` holding NaN or ±inf."""
    for name, array in arrays.items():
        if not np.all(np.isfinite(array)):
            raise AggregationError(f"{what} {name!r} is not finite (overflow or NaN)")


def b_matrix(
    releases: Sequence[PlannedRelease],
    sums: Mapping[str, NDArray[np.float64]],
    *,
    classes: Sequence[str],
    kind: int,
) -> NDArray[np.float64]:
    """(d, C) matrix of the class vector sums of ``kind``; zero columns for classes without one."""
    d = next(r.shape[0] for r in releases)
    out = np.zeros((d, len(classes)), dtype=np.float64)
    for r in releases:
        if r.kind == kind:
            for j, cls in enumerate(r.class_names):
                out[:, classes.index(cls)] = sums[r.name][:, j]
    return out


def solve_round_one(
    releases: Sequence[PlannedRelease],
    sums: Mapping[str, NDArray[np.float64]],
    *,
    classes: Sequence[str],
    participants: Sequence[str],
    gram_scope: GramScope,
    gamma: float,
) -> NDArray[np.float64]:
    """W (d, C) from the round-1 sums (eq. 15 or its global variant)."""
    index = {s: k for k, s in enumerate(sorted(participants))}

    def cover(members: Sequence[str]) -> Cover:
        return frozenset(index[s] for s in members)

    everyone: Cover = frozenset(index.values())
    class_cover: list[Cover] = [frozenset()] * len(classes)
    for r in releases:
        if r.kind == common_pb2.STATISTIC_KIND_CLASS_VECTOR:
            for cls in r.class_names:
                class_cover[classes.index(cls)] = cover(r.members)
    if gram_scope == "global":
        gram_cover = tuple(everyone if c else frozenset() for c in class_cover)
    else:
        gram_cover = tuple(class_cover)
    plan = AggregationPlan(gram_scope, everyone, tuple(class_cover), gram_cover)
    gram_sums = {
        cover(r.members): sums[r.name] for r in releases if r.kind == common_pb2.STATISTIC_KIND_GRAM
    }
    b_sums = b_matrix(releases, sums, classes=classes, kind=common_pb2.STATISTIC_KIND_CLASS_VECTOR)
    return solve_from_sums(plan, gram_sums=gram_sums, b_sums=b_sums, gamma=gamma)


def solve_round_two(
    round1_releases: Sequence[PlannedRelease],
    round1_sums: Mapping[str, NDArray[np.float64]],
    round2_releases: Sequence[PlannedRelease],
    round2_sums: Mapping[str, NDArray[np.float64]],
    *,
    classes: Sequence[str],
    gamma: float,
    alpha: float,
) -> NDArray[np.float64]:
    """W (d, C) of round 2 (eq. 20-22)."""
    b_real = b_matrix(
        round1_releases, round1_sums, classes=classes, kind=common_pb2.STATISTIC_KIND_CLASS_VECTOR
    )
    b_pseudo = b_matrix(
        round2_releases,
        round2_sums,
        classes=classes,
        kind=common_pb2.STATISTIC_KIND_PSEUDO_CLASS_VECTOR,
    )
    return solve_round2(
        gram_total=round1_sums[GLOBAL_GRAM],
        b_real=b_real,
        b_pseudo=b_pseudo,
        alpha=alpha,
        gamma=gamma,
    )


def build_signed_model(
    weights: NDArray[np.float64],
    *,
    identity_key: Ed25519PrivateKey,
    federation_id: str,
    round_id: str,
    round_number: int,
    classes: Sequence[str],
    gamma: float,
    backbone: str,
    contributors: Sequence[str],
    plan_bytes: bytes,
    context: str = MODEL_CONTEXT,
) -> coordinator_pb2.SignedModel:
    """Serialize the Model once and sign those bytes (``context`` "model", or "candidate-model"
    for a candidate the validation gate scores before it is published)."""
    w = np.ascontiguousarray(weights, dtype="<f8")
    model = coordinator_pb2.Model(
        version=1,
        federation_id=federation_id,
        round_id=round_id,
        round_number=round_number,
        class_names=list(classes),
        weights=common_pb2.Tensor(
            shape=list(w.shape),
            dtype=common_pb2.DTYPE_FLOAT64_LE,
            packing=common_pb2.PACKING_DENSE,
            data=w.tobytes(),
        ),
        gamma=gamma,
        decision_threshold=0.5,
        backbone=backbone,
        contributors=sorted(contributors),
        plan_sha256=blob_sha256(plan_bytes),
        created_unix_ms=int(time.time() * 1000),
    )
    blob = model.SerializeToString()
    return coordinator_pb2.SignedModel(
        model=blob, signature=sign_blob(identity_key, context=context, blob=blob)
    )
