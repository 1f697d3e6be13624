"""A site's evaluation payloads (afl.client.payloads.evaluation) and their audit by the site's policy
(afl.client.policy.plan): sums of the sites' payloads, masked in process, equal the statistics of the
pooled rows and give the pooled metrics; a release for another model or with bad bins is
refused; a plan that exposes the site's evaluation statistics by differencing is refused."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from afl.client.config import LocalPolicy
from afl.client.payloads.evaluation import evaluation_slot_payloads, evaluation_values
from afl.client.payloads.stats import PayloadError, encode_float64
from afl.client.policy.plan import audit_view, check_plan
from afl.core.data.featurecache import CacheMeta, FeatureCache, write_cache
from afl.core.evaluation.federated import EvaluationStats, evaluation_statistics, pooled_metrics
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS
from afl.crypto.identity.signatures import generate_identity_key
from afl.crypto.secagg.config import ReleaseSpec, RoundConfig
from afl.crypto.secagg.local import run_local_round
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.wire import evaluation_shape, evaluation_spec

CLASSES = ("A", "B", "C")
SITES = ["s1", "s2", "s3", "s4"]
MODEL = hashlib.sha256(b"model").digest()
D = 5


def _release(kind: int, members: list[str], *, name: str = "", model: bytes = MODEL) -> cpb.Release:
    bins = DEFAULT_SCORE_BINS
    return cpb.Release(
        name=name or f"eval/{cpb.StatisticKind.Name(kind).lower()}",  # type: ignore[arg-type]
        member_site_ids=members,
        kind=kind,  # type: ignore[arg-type]
        class_names=list(CLASSES),
        shape=evaluation_shape(kind, classes=len(CLASSES), bins=bins),
        evaluation=evaluation_spec(model_sha256=model, bins=bins),
    )


HIST = cpb.STATISTIC_KIND_SCORE_HISTOGRAM
CONF = cpb.STATISTIC_KIND_CONFUSION_COUNTS


def _plan(releases: list[cpb.Release]) -> cpb.ReleasePlan:
    return cpb.ReleasePlan(
        round_id="eval-1",
        participants=SITES,
        aggregation=cpb.AGGREGATION_MODE_PLAINTEXT,
        releases=releases,
    )


def _caches(root: Path) -> tuple[list[FeatureCache], np.ndarray]:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(D, len(CLASSES))) * 1e-3
    caches = []
    for k, site in enumerate(SITES):
        n = 60 + 10 * k
        labels = (rng.random((n, 3)) < 0.35).astype(np.int8)
        labels[:, 2] = -1 if k == 0 else labels[:, 2]  # s1 does not label C
        feats = (rng.normal(size=(n, D)) + labels.clip(0) @ rng.normal(size=(3, D))).astype(
            np.float32
        )
        meta = CacheMeta(n=n, d=D, classes=CLASSES, source="test")
        caches.append(
            write_cache(
                root / site,
                meta=meta,
                ids=[f"{site}-{i}" for i in range(n)],
                labels=labels,
                features=feats,
            )
        )
    return caches, w


def _encode(release: cpb.Release, values: np.ndarray) -> bytes:
    return encode_float64(values)


def test_masked_sum_of_site_payloads_gives_the_pooled_metrics(tmp_path: Path) -> None:
    caches, w = _caches(tmp_path)
    plan = _plan([_release(HIST, SITES), _release(CONF, SITES)])
    values: dict[str, dict[str, np.ndarray]] = {}
    for site, cache in zip(SITES, caches, strict=True):
        labelled = np.asarray((cache.labels >= 0).all(axis=0), dtype=bool)
        payloads = evaluation_slot_payloads(
            plan,
            site_id=site,
            cache=cache,
            labelled=labelled,
            weights=w,
            model_classes=CLASSES,
            model_sha256=MODEL.hex(),
            encode=_encode,
        )
        assert [p.slot for p in payloads] == [r.name for r in plan.releases]
        values[site] = {p.slot: np.frombuffer(p.payload, dtype="<f8").copy() for p in payloads}
    # the coordinator sums masked uploads (docs/protocol.md §4.2), in process here
    bound = float(max(c.meta.n for c in caches))
    specs = [ReleaseSpec(r.name, tuple(SITES), int(np.prod(r.shape)), bound) for r in plan.releases]
    config = RoundConfig.create(round_id="eval-1", cohort=SITES, releases=specs)
    keys = {s: generate_identity_key() for s in SITES}
    sums = run_local_round(config=config, identity_keys=keys, inputs=values).result.sums
    released = EvaluationStats.from_sums(
        classes=CLASSES,
        bins=DEFAULT_SCORE_BINS,
        threshold=0.5,
        histograms=sums[plan.releases[0].name],
        confusion=sums[plan.releases[1].name],
    )
    # oracle: the pooled rows, each class on the rows labelled for it
    feats = np.concatenate([np.asarray(c.features, dtype=np.float64) for c in caches])
    labels = np.concatenate([c.labels for c in caches])
    pooled = evaluation_statistics(
        feats, labels, weights=w, classes=CLASSES, bins=DEFAULT_SCORE_BINS
    )
    np.testing.assert_array_equal(released.histograms, pooled.histograms)
    np.testing.assert_array_equal(released.confusion, pooled.confusion)
    metrics = pooled_metrics(released)
    z = feats @ w
    for c in range(3):
        rows = labels[:, c] >= 0
        binned = DEFAULT_SCORE_BINS.index(z[rows, c])
        assert metrics.auc[c] == pytest.approx(roc_auc_score(labels[rows, c], binned), abs=1e-12)
    assert released.n_pos[2] == sum((c.labels[:, 2] == 1).sum() for c in caches[1:])


def test_releases_for_another_model_or_with_bad_bins_are_refused(tmp_path: Path) -> None:
    caches, w = _caches(tmp_path)
    kw = {
        "cache": caches[1],
        "labelled": np.ones(3, bool),
        "weights": w,
        "model_classes": CLASSES,
        "model_sha256": MODEL.hex(),
    }
    other = _release(HIST, SITES, model=hashlib.sha256(b"other").digest())
    with pytest.raises(PayloadError, match="not the model this site verified"):
        evaluation_values(other, **kw)  # type: ignore[arg-type]
    bad = _release(HIST, SITES)
    del bad.evaluation.score_bin_edges[:]
    bad.evaluation.score_bin_edges.extend([1.0, 0.5])
    with pytest.raises(PayloadError, match="strictly increasing"):
        evaluation_values(bad, **kw)  # type: ignore[arg-type]
    wrong_shape = _release(CONF, SITES)
    wrong_shape.shape[:] = [3, 5]
    with pytest.raises(PayloadError, match="shape"):
        evaluation_values(wrong_shape, **kw)  # type: ignore[arg-type]
    # a non-member sends nothing
    assert (
        evaluation_slot_payloads(
            _plan([_release(HIST, SITES[1:])]),
            site_id="s1",
            encode=_encode,
            **kw,  # type: ignore[arg-type]
        )
        == []
    )


def test_policy_refuses_an_evaluation_plan_that_exposes_the_site() -> None:
    # the confusion counts over s2..s4 differenced against the histograms over everyone
    # determine s1's statistics (one quantity per class and model, docs/protocol.md §6)
    exposing = _plan([_release(HIST, SITES), _release(CONF, SITES[1:])])
    policy = LocalPolicy(allowed_aggregation=("plaintext", "mask", "ckks"))  # a plaintext plan
    refused = check_plan(exposing, site_id="s1", policy=policy)
    assert not refused.accept
    assert f"eval[A]@{MODEL.hex()}" in refused.reason or "labels[A]" in refused.reason
    # the other members refuse it too: a site's metrics must not be recoverable (M-99)
    other = check_plan(exposing, site_id="s2", policy=policy)
    assert not other.accept and "sum of {s1} by differencing" in other.reason
    fine = _plan([_release(HIST, SITES), _release(CONF, SITES)])
    assert all(check_plan(fine, site_id=s, policy=policy).accept for s in SITES)
    # with an earlier evaluation of another model over everyone, evaluating over s2..s4
    # exposes s1's label counts through labels[c]; s1, not a member of the later plan, never
    # sees it, so its members refuse it on s1's behalf (M-99)
    history_plan = _plan([_release(HIST, SITES, model=hashlib.sha256(b"m0").digest())])
    history = audit_view(list(history_plan.releases), tag="eval-0/")
    later = _plan([_release(HIST, SITES[1:])])
    decision = check_plan(later, site_id="s2", policy=policy, history=history)
    assert not decision.accept
    assert decision.reason.startswith(
        "with the evaluations this site took part in, the plan determines the labels[A] sum of "
        "{s1} by differencing"
    ), decision.reason
    exposed = {(e["quantity"], tuple(e["sites"])) for e in decision.audit["exposed_sites"]}
    assert ("labels[A]", ("s1",)) in exposed
    assert check_plan(later, site_id="s2", policy=policy).accept  # without that history: fine


def test_classes_the_site_does_not_hold_or_label_send_zeros(tmp_path: Path) -> None:
    caches, w = _caches(tmp_path)
    source = caches[1]  # labels A, B, C
    narrow = write_cache(  # the same rows holding only A and B
        tmp_path / "narrow",
        meta=CacheMeta(n=source.meta.n, d=D, classes=CLASSES[:2], source="test"),
        ids=list(source.ids),
        labels=np.asarray(source.labels[:, :2]),
        features=np.asarray(source.features),
    )
    release = _release(HIST, SITES)
    kw: dict[str, Any] = {"weights": w, "model_classes": CLASSES, "model_sha256": MODEL.hex()}
    every = np.ones(3, bool)
    full = evaluation_values(release, cache=source, labelled=every, **kw).reshape(3, 2, -1)
    held = evaluation_values(release, cache=narrow, labelled=every[:2], **kw).reshape(3, 2, -1)
    np.testing.assert_array_equal(held[:2], full[:2])
    assert full[2].sum() > 0 and not held[2].any()  # C: not in the cache, zeros
    some = np.array([True, False, True])
    unlabelled = evaluation_values(release, cache=source, labelled=some, **kw).reshape(3, 2, -1)
    assert not unlabelled[1].any() and unlabelled[2].sum() == full[2].sum()
    with pytest.raises(PayloadError, match=r"classes \['C'\] are not the model's"):
        evaluation_values(
            release, cache=source, labelled=every, **{**kw, "model_classes": ("A", "B")}
        )
