"""The site's statistics cache, release payloads and signature checks of the client daemon."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from afl.client.daemon.verify import VerificationError, verify_model, verify_round_config
from afl.client.modes.base import PlaintextMode
from afl.client.payloads.stats import (
    PayloadError,
    labelled_mask,
    load_or_compute_pseudo,
    load_or_compute_stats,
    round_classes,
    slot_payloads,
)
from afl.core.data.featurecache import CacheMeta, FeatureCache, write_cache
from afl.core.packing import unpack_upper
from afl.core.refinement import RefinementParams, pseudo_label_projection
from afl.core.stats import local_statistics
from afl.crypto.identity import signatures, signed_blobs
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

CLASSES = ("A", "B", "C")
D = 5


def _cache(root: Path, seed: int = 0) -> FeatureCache:
    rng = np.random.default_rng(seed)
    n = 60
    labels = rng.integers(0, 2, size=(n, 3)).astype(np.int8)
    labels[:, 2] = -1  # the site does not label C
    feats = rng.normal(size=(n, D)).astype(np.float32)
    meta = CacheMeta(n=n, d=D, classes=CLASSES, source="test", surrogate=True)
    return write_cache(
        root, meta=meta, ids=[str(i) for i in range(n)], labels=labels, features=feats
    )


def _release(
    name: str, kind: int, classes: list[str], shape: list[int], packing: int, slot: str = ""
):
    return cpb.Release(
        name=name,
        member_site_ids=["me", "x", "y"],
        kind=kind,  # type: ignore[arg-type]
        class_names=classes,
        shape=shape,
        encoding=cpb.Encoding(dtype=cpb.DTYPE_FLOAT64_LE, packing=packing),  # type: ignore[arg-type]
        upload_name=slot or name,
    )


def test_labelled_mask_and_stats_cached_in_state(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "cache")
    mask, names = labelled_mask(cache, ())
    assert mask.tolist() == [True, True, False] and names == ["A", "B"]
    with pytest.raises(PayloadError, match=r"\['C'\] have unlabelled"):
        labelled_mask(cache, ("A", "C"))
    with pytest.raises(PayloadError, match=r"'Z' are not columns .* its classes are"):
        labelled_mask(cache, ("Z",))
    stats, cached = load_or_compute_stats(cache, active=mask, state_dir=tmp_path / "state")
    assert not cached
    oracle = local_statistics(cache.features, cache.labels, active=mask)
    np.testing.assert_array_equal(stats.gram, oracle.gram)
    np.testing.assert_array_equal(stats.b, oracle.b)
    again, cached = load_or_compute_stats(cache, active=mask, state_dir=tmp_path / "state")
    assert cached
    np.testing.assert_array_equal(again.gram, oracle.gram)
    assert again.contributes.tolist() == oracle.contributes.tolist()
    # A different labelled set is a different key: recomputed.
    only_a = np.array([True, False, False])
    _, cached = load_or_compute_stats(cache, active=only_a, state_dir=tmp_path / "state")
    assert not cached
    # The site's own statistics are kept private: folders 0700, files 0600.
    for path in [tmp_path / "state", *(tmp_path / "state").rglob("*")]:
        assert path.stat().st_mode & 0o777 == (0o700 if path.is_dir() else 0o600), path


def test_pseudo_stats_cached_and_exact(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "cache")
    w = np.random.default_rng(1).normal(size=(D, 3))
    missing = np.array([False, False, True])
    params = RefinementParams(tau=0.6, alpha=0.5, delta_pos=1, delta_neg=1)
    kw = {"weights": w, "missing": missing, "params": params, "state_dir": tmp_path / "s"}
    first, cached = load_or_compute_pseudo(cache, **kw)  # type: ignore[arg-type]
    assert not cached
    second, cached = load_or_compute_pseudo(cache, **kw)  # type: ignore[arg-type]
    assert cached
    oracle = pseudo_label_projection(cache.features, weights=w, missing=missing, params=params)
    np.testing.assert_array_equal(second.b, oracle.b)
    np.testing.assert_array_equal(first.b, oracle.b)


def test_slot_payloads_follow_the_plan(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "cache")
    mask, _ = labelled_mask(cache, ())
    stats, _ = load_or_compute_stats(cache, active=mask, state_dir=tmp_path / "state")
    gram = _release("gram[all]", cpb.STATISTIC_KIND_GRAM, [], [D, D], cpb.PACKING_UPPER_TRIANGLE)
    b_c = _release("b[C]", cpb.STATISTIC_KIND_CLASS_VECTOR, ["C"], [D, 1], cpb.PACKING_DENSE)
    b_ab = _release(
        "b[B,A]", cpb.STATISTIC_KIND_CLASS_VECTOR, ["B", "A"], [D, 2], cpb.PACKING_DENSE
    )
    other = cpb.Release(name="b[A]", member_site_ids=["x", "y", "z"])  # not ours: skipped
    plan = cpb.ReleasePlan(releases=[gram, b_c, b_ab, other])
    out = slot_payloads(
        plan, site_id="me", class_names=CLASSES, stats=stats, pseudo=None,
        encode=PlaintextMode().encode,
    )  # fmt: skip
    by_slot = {p.slot: p for p in out}
    assert set(by_slot) == {"gram[all]", "b[C]", "b[B,A]"}
    g = unpack_upper(np.frombuffer(by_slot["gram[all]"].payload, dtype="<f8"))
    np.testing.assert_array_equal(g, stats.gram)
    assert by_slot["gram[all]"].sha256 == hashlib.sha256(by_slot["gram[all]"].payload).hexdigest()
    assert not np.frombuffer(by_slot["b[C]"].payload, dtype="<f8").any()  # non-labeller: zeros
    bab = np.frombuffer(by_slot["b[B,A]"].payload, dtype="<f8").reshape(D, 2)
    np.testing.assert_array_equal(bab, stats.b[:, [1, 0]])
    # Two releases sharing a slot must agree on the payload.
    shared = cpb.ReleasePlan(
        releases=[
            gram,
            _release(
                "g2", cpb.STATISTIC_KIND_GRAM, [], [D, D], cpb.PACKING_UPPER_TRIANGLE, "gram[all]"
            ),
        ]
    )
    (one,) = slot_payloads(
        shared, site_id="me", class_names=CLASSES, stats=stats, pseudo=None,
        encode=PlaintextMode().encode,
    )  # fmt: skip
    assert one.releases == ("gram[all]", "g2")
    clash = cpb.ReleasePlan(
        releases=[
            b_c,
            _release(
                "b2", cpb.STATISTIC_KIND_CLASS_VECTOR, ["A"], [D, 1], cpb.PACKING_DENSE, "b[C]"
            ),
        ]
    )
    with pytest.raises(PayloadError, match="share upload slot"):
        slot_payloads(
            clash,
            site_id="me",
            class_names=CLASSES,
            stats=stats,
            pseudo=None,
            encode=PlaintextMode().encode,
        )
    for bad, msg in [
        (_release("g", cpb.STATISTIC_KIND_GRAM, [], [D, D + 1], cpb.PACKING_DENSE), "Gram shape"),
        (
            _release("b", cpb.STATISTIC_KIND_CLASS_VECTOR, ["Q"], [D, 1], cpb.PACKING_DENSE),
            "unknown",
        ),
        (_release("b", cpb.STATISTIC_KIND_CLASS_VECTOR, ["A"], [D, 2], cpb.PACKING_DENSE), "shape"),
        (
            _release("p", cpb.STATISTIC_KIND_PSEUDO_CLASS_VECTOR, ["A"], [D, 1], cpb.PACKING_DENSE),
            "round 2",
        ),
    ]:
        with pytest.raises(PayloadError, match=msg):
            slot_payloads(
                cpb.ReleasePlan(releases=[bad]),
                site_id="me",
                class_names=CLASSES,
                stats=stats,
                pseudo=None,
                encode=PlaintextMode().encode,
            )


def _signed_config(key, *, plan: cpb.ReleasePlan, round_id: str = "r1") -> pb.RoundConfig:
    blob = plan.SerializeToString()
    sig = signed_blobs.sign_blob(key, context=signed_blobs.PLAN_CONTEXT, blob=blob)
    return pb.RoundConfig(
        federation_id="fed",
        round_id=round_id,
        round_number=plan.round_number,
        participants=list(plan.participants),
        aggregation=plan.aggregation,
        gram_scope=plan.gram_scope,
        release_plan=cpb.SignedReleasePlan(plan=blob, signature=sig),
    )


def test_plan_signature_and_binding() -> None:
    key = signatures.generate_identity_key()
    pub = key.public_key()
    plan = cpb.ReleasePlan(
        federation_id="fed", round_id="r1", round_number=1, participants=["a", "b", "c"],
        aggregation=cpb.AGGREGATION_MODE_PLAINTEXT,
    )  # fmt: skip
    got, digest = verify_round_config(
        _signed_config(key, plan=plan), server_key=pub, federation_id="fed"
    )
    assert got == plan and digest == hashlib.sha256(plan.SerializeToString()).digest()
    forged = _signed_config(signatures.generate_identity_key(), plan=plan)
    with pytest.raises(VerificationError, match="not signed by this federation's server"):
        verify_round_config(forged, server_key=pub, federation_id="fed")
    replayed = _signed_config(key, plan=plan, round_id="r2")
    with pytest.raises(VerificationError, match="bound to round 'r1', not 'r2'"):
        verify_round_config(replayed, server_key=pub, federation_id="fed")
    with pytest.raises(VerificationError, match="federation"):
        verify_round_config(_signed_config(key, plan=plan), server_key=pub, federation_id="other")


def test_model_verification() -> None:
    key = signatures.generate_identity_key()
    w = np.arange(6, dtype=np.float64).reshape(3, 2)

    def signed(**over: object) -> pb.SignedModel:
        fields: dict[str, object] = {
            "federation_id": "fed", "round_id": "r1", "class_names": ["A", "B"],
            "plan_sha256": b"p" * 32,
            "weights": cpb.Tensor(shape=[3, 2], dtype=cpb.DTYPE_FLOAT64_LE, packing=cpb.PACKING_DENSE, data=w.astype("<f8").tobytes()),
        }  # fmt: skip
        fields.update(over)
        blob = pb.Model(**fields).SerializeToString()  # type: ignore[arg-type]
        sig = signed_blobs.sign_blob(key, context=signed_blobs.MODEL_CONTEXT, blob=blob)
        return pb.SignedModel(model=blob, signature=sig)

    kw = {"server_key": key.public_key(), "federation_id": "fed", "round_id": "r1",
          "class_names": ["A", "B"], "d": 3, "plan_sha256": b"p" * 32}  # fmt: skip
    got = verify_model(signed(), **kw)  # type: ignore[arg-type]
    np.testing.assert_array_equal(got.weights, w)
    with pytest.raises(VerificationError, match="different release plan"):
        verify_model(signed(plan_sha256=b"q" * 32), **kw)  # type: ignore[arg-type]
    with pytest.raises(VerificationError, match="classes differ"):
        verify_model(signed(class_names=["B", "A"]), **kw)  # type: ignore[arg-type]
    nan = cpb.Tensor(shape=[3, 2], dtype=cpb.DTYPE_FLOAT64_LE, data=np.full(6, np.nan).tobytes())
    with pytest.raises(VerificationError, match="NaN"):
        verify_model(signed(weights=nan), **kw)  # type: ignore[arg-type]
    tampered = signed()
    tampered.model = tampered.model[:-1] + bytes([tampered.model[-1] ^ 1])
    with pytest.raises(VerificationError, match="not signed"):
        verify_model(tampered, **kw)  # type: ignore[arg-type]


def test_round_classes_may_differ_from_the_cache(tmp_path: Path) -> None:
    """A site whose cache holds only some of the round's classes (and one the round does not use)
    contributes zeros for the others and says so in one line; the oracle is the statistics
    computed directly over the round's class list with the absent classes unlabelled."""
    cache = _cache(tmp_path / "cache")  # columns A, B (labelled), C (-1)
    labelled, _ = labelled_mask(cache, ())
    stats, _ = load_or_compute_stats(cache, active=labelled, state_dir=tmp_path / "state")
    round_names = ["Mass", "B", "A", "C"]  # Mass: not in the cache; C: not labelled here
    view = round_classes(
        stats, cache_classes=cache.meta.classes, labelled=labelled, round_classes=round_names
    )
    labels = view.labels(cache.labels)
    np.testing.assert_array_equal(labels[:, 0], -1)
    np.testing.assert_array_equal(labels[:, 1:3], cache.labels[:, [1, 0]])
    direct = local_statistics(cache.features, labels, active=np.array([False, True, True, False]))
    np.testing.assert_allclose(view.stats.b, direct.b, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(view.stats.contributes, [False, True, True, False])
    np.testing.assert_array_equal(view.labelled, [False, True, True, False])
    assert view.stats.gram is stats.gram
    assert view.note == (
        "this site labels 2 of the round's 4 classes; it contributes nothing for ['Mass', 'C'] "
        "(zeros, or no release, per the plan)"
    )
    # A labelled cache class the round does not use is named, with a hint for a misspelling.
    renamed = round_classes(
        stats,
        cache_classes=("Efusion", "B", "C"),
        labelled=labelled,
        round_classes=["Effusion", "B"],
    )
    assert (
        "labelled cache classes the round does not use: 'Efusion' (did you mean 'Effusion'?)"
        in renamed.note
    )
    same = round_classes(
        stats, cache_classes=CLASSES, labelled=np.ones(3, bool), round_classes=list(CLASSES)
    )
    assert same.note == ""
    # Payloads for a plan over the round's classes: the absent class's columns are zeros.
    plan = cpb.ReleasePlan(
        releases=[
            _release(
                "b[Mass]", cpb.STATISTIC_KIND_CLASS_VECTOR, ["Mass"], [D, 1], cpb.PACKING_DENSE
            )
        ]
    )
    (slot,) = slot_payloads(
        plan, site_id="me", class_names=round_names, stats=view.stats, pseudo=None,
        encode=PlaintextMode().encode,
    )  # fmt: skip
    assert np.frombuffer(slot.payload, "<f8").tolist() == [0.0] * D
