"""A site's part in a run's evaluation round (afl.client.daemon.evaluation, docs/protocol.md
§6.1): it evaluates only a model it verified itself (kept in its state, signature of its kit's
server key, the plan's digest), on its hold-out cache when it has one (else in-sample), and keeps
the coordinator's evaluation only once its signature and documents check out."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afl.client.config import DataConfig, LocalPolicy
from afl.client.daemon.evaluation import (
    evaluated_model,
    evaluation_problem,
    evaluation_rows,
    save_evaluation,
)
from afl.client.daemon.report import RoundReport
from afl.client.daemon.state import DaemonState
from afl.client.daemon.verify import VerificationError, verify_evaluation
from afl.client.payloads.evaluation import is_evaluation_plan
from afl.client.payloads.stats import PayloadError
from afl.client.policy.plan import audit_view, check_plan
from afl.core.data.featurecache import CacheMeta, open_cache, write_cache
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS
from afl.crypto.identity.signatures import generate_identity_key, public_key_to_raw
from afl.crypto.identity.signed_blobs import EVALUATION_CONTEXT, sign_blob
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.wire import evaluation_shape, evaluation_spec
from afl.server.config import MaskSettings
from afl.server.modes.mask import MaskMode
from afl.server.plan.release import build_plan
from afl.server.solve.evaluation import evaluation_releases
from afl.server.solve.model import build_signed_model

FEDERATION = "fed-eval"
CLASSES = ("A", "B")
D = 4
HIST, CONF = cpb.STATISTIC_KIND_SCORE_HISTOGRAM, cpb.STATISTIC_KIND_CONFUSION_COUNTS


def _model(state: Path, key, round_id: str) -> str:
    """A signed model kept in ``state/models`` as the daemon keeps it; its digest (hex)."""
    signed = build_signed_model(
        np.full((D, len(CLASSES)), 0.01),
        identity_key=key,
        federation_id=FEDERATION,
        round_id=round_id,
        round_number=1,
        classes=CLASSES,
        gamma=1.0,
        backbone="",
        contributors=["s1", "s2", "s3"],
        plan_bytes=b"plan",
    )
    (state / "models").mkdir(parents=True, exist_ok=True)
    (state / "models" / f"{round_id}.signed-model.pb").write_bytes(signed.SerializeToString())
    return hashlib.sha256(signed.model).hexdigest()


def _release(kind: int, digest: str, **spec) -> cpb.Release:
    bins = spec.pop("bins", DEFAULT_SCORE_BINS)
    return cpb.Release(
        name=f"eval/{kind}",
        member_site_ids=["s1", "s2", "s3"],
        kind=kind,  # type: ignore[arg-type]
        class_names=list(CLASSES),
        shape=evaluation_shape(kind, classes=len(CLASSES), bins=bins),
        evaluation=evaluation_spec(model_sha256=bytes.fromhex(digest), bins=bins, **spec),
    )


def _plan(*releases: cpb.Release) -> cpb.ReleasePlan:
    return cpb.ReleasePlan(round_id="e2-x", participants=["s1", "s2", "s3"], releases=releases)


def test_a_site_evaluates_only_a_model_it_verified_itself(tmp_path: Path) -> None:
    server, other = generate_identity_key(), generate_identity_key()
    state = tmp_path / "state"
    mine = _model(state, server, "r1-mine")
    source: dict[str, Any] = {
        "state_dir": state,
        "server_public_key": public_key_to_raw(server.public_key()),
        "federation_id": FEDERATION,
    }
    plan = _plan(_release(HIST, mine), _release(CONF, mine))
    assert is_evaluation_plan(plan) and evaluation_problem(plan, **source) == ""
    assert evaluated_model(plan, **source).model_sha256 == mine
    # a model no round gave this site (e.g. a crafted W): refused
    crafted = hashlib.sha256(b"a model this site never received").hexdigest()
    problem = evaluation_problem(_plan(_release(HIST, crafted)), **source)
    assert problem.startswith(f"the plan evaluates model {crafted[:16]}…, which this site has not")
    # a file in the state with the plan's digest but signed by another key: not verified
    foreign = _model(tmp_path / "elsewhere", other, "r1-foreign")
    (state / "models" / "r1-foreign.signed-model.pb").write_bytes(
        (tmp_path / "elsewhere" / "models" / "r1-foreign.signed-model.pb").read_bytes()
    )
    assert "has not verified" in evaluation_problem(_plan(_release(HIST, foreign)), **source)
    # one model per plan, evaluation releases only, valid bins and threshold
    second = _model(state, server, "r1-second")
    two = evaluation_problem(_plan(_release(HIST, mine), _release(CONF, second)), **source)
    assert two == "the plan's releases evaluate 2 models, not one"
    gram = cpb.Release(name="gram[all]", kind=cpb.STATISTIC_KIND_GRAM, shape=[D, D])
    mixed = evaluation_problem(_plan(_release(HIST, mine), gram), **source)
    assert mixed == "an evaluation plan must hold evaluation releases only"
    fine = _release(HIST, mine)
    fine.evaluation.score_bin_edges[:] = list(np.arange(5000.0))  # a bin per image, nearly
    assert "score-bin edges > the limit 4096" in evaluation_problem(_plan(fine), **source)
    assert "decision threshold" in evaluation_problem(
        _plan(_release(CONF, mine, threshold=1.0)), **source
    )


def _cache(root: Path, n: int, d: int = D):
    rng = np.random.default_rng(n)
    labels = (rng.random((n, len(CLASSES))) < 0.4).astype(np.int8)
    labels[:, 1] = -1  # B is not labelled here
    meta = CacheMeta(n=n, d=d, classes=CLASSES, source="test")
    features = rng.normal(size=(n, d)).astype(np.float32)
    return write_cache(
        root, meta=meta, ids=[str(i) for i in range(n)], labels=labels, features=features
    )


def test_the_site_chooses_the_rows_it_evaluates(tmp_path: Path) -> None:
    training = _cache(tmp_path / "train", 50)
    labelled = np.array([True, False])
    rows = evaluation_rows(
        DataConfig(cache=tmp_path / "train"), training=training, labelled=labelled
    )
    assert rows.in_sample and rows.cache is training and rows.to_json()["rows"] == 50
    _cache(tmp_path / "holdout", 20)
    data = DataConfig(cache=tmp_path / "train", classes=("A",), holdout=tmp_path / "holdout")
    rows = evaluation_rows(data, training=training, labelled=labelled)
    assert not rows.in_sample and rows.cache.meta.n == 20 and list(rows.labelled) == [True, False]
    _cache(tmp_path / "wide", 20, d=D + 1)
    wide = DataConfig(cache=tmp_path / "train", holdout=tmp_path / "wide")
    with pytest.raises(
        PayloadError, match=r"\[data\] holdout .* has d = 5, the training cache d = 4"
    ):
        evaluation_rows(wide, training=training, labelled=labelled)
    missing = DataConfig(cache=tmp_path / "train", holdout=tmp_path / "nowhere")
    with pytest.raises(PayloadError, match="nowhere"):
        evaluation_rows(missing, training=training, labelled=labelled)
    assert open_cache(tmp_path / "holdout").meta.n == 20


def _signed_evaluation(
    key, digest: str, *, calibration_model: str | None = None
) -> pb.SignedEvaluation:
    document = {"format": "afl-federated-evaluation", "model_sha256": digest, "per_class": {}}
    calibration = {
        "format": "afl-calibration",
        "version": 1,
        "method": "platt",
        "model_sha256": calibration_model or digest,
        "score_bin_edges": [0.0],
        "classes": [
            {"name": "A", "fitted": True, "n_pos": 3, "n_neg": 4, "slope": 2.0, "intercept": 0.1}
        ],
    }
    evaluation = pb.Evaluation(
        version=1,
        federation_id=FEDERATION,
        round_id="e2-x",
        model_round_id="r1-mine",
        model_sha256=bytes.fromhex(digest),
        members=["s1", "s2", "s3"],
        evaluation_json=json.dumps(document).encode(),
        calibration_json=json.dumps(calibration).encode(),
    )
    blob = evaluation.SerializeToString()
    return pb.SignedEvaluation(
        evaluation=blob, signature=sign_blob(key, context=EVALUATION_CONTEXT, blob=blob)
    )


def test_a_signed_evaluation_is_kept_only_once_it_checks_out(tmp_path: Path) -> None:
    server, other = generate_identity_key(), generate_identity_key()
    digest = hashlib.sha256(b"model").hexdigest()
    signed = _signed_evaluation(server, digest)
    check: dict[str, Any] = {
        "server_key": server.public_key(),
        "federation_id": FEDERATION,
        "round_id": "e2-x",
    }
    evaluation = verify_evaluation(signed, model_sha256=digest, **check)
    files = save_evaluation(signed, evaluation, tmp_path / "evaluations")
    assert Path(files["calibration"]).name == "r1-mine.calibration.json"
    assert Path(files["evaluation"]).read_bytes() == evaluation.evaluation_json
    with pytest.raises(VerificationError, match="not signed by this federation's server"):
        verify_evaluation(_signed_evaluation(other, digest), **check)
    another = hashlib.sha256(b"another model").hexdigest()
    with pytest.raises(VerificationError, match="it evaluates model"):
        verify_evaluation(signed, model_sha256=another, **check)
    with pytest.raises(VerificationError, match="its calibration is for another model"):
        verify_evaluation(_signed_evaluation(server, digest, calibration_model=another), **check)
    with pytest.raises(VerificationError, match="it is for round 'e2-x', not 'e3-y'"):
        verify_evaluation(signed, **{**check, "round_id": "e3-y"})


def _masked_evaluation_plan(digest: str, sites: list[str]) -> cpb.ReleasePlan:
    """An evaluation plan over ``sites`` as the coordinator builds it in MASK mode."""
    participants = tuple(sites)
    mode = MaskMode(  # counts of at most N = 500 rows per site
        MaskSettings(gram_bound=1.0, vector_bound=1.0, max_samples=500),
        identities={s: public_key_to_raw(generate_identity_key().public_key()) for s in sites},
    )
    releases = evaluation_releases(
        classes=CLASSES, participants=participants, model_sha256=bytes.fromhex(digest)
    )
    return build_plan(
        federation_id=FEDERATION, round_id="e2-m", round_number=2, participants=participants,
        gram_scope="global", releases=releases, options=mode.plan_options(participants),
    )  # fmt: skip


def _aborted(round_id: str, *, bytes_sent: int) -> RoundReport:
    """A site's report of a round aborted after ``bytes_sent`` bytes left it."""
    report = RoundReport("s1", FEDERATION, "run", round_id, 1, bytes_sent=bytes_sent)
    report.outcome = "ABORTED"
    return report


def test_a_masked_evaluation_plan_meets_the_sites_own_policy(tmp_path: Path) -> None:
    """What the site checks itself, whatever the coordinator chose: the survivor floor of each
    evaluation release, the min cohort, and differencing against the evaluations it took part
    in (docs/protocol.md §6, §6.1)."""
    server = generate_identity_key()
    state = tmp_path / "state"
    digest = _model(state, server, "r1-mine")
    sites = ["s1", "s2", "s3", "s4"]
    mask = (cpb.AGGREGATION_MODE_MASK,)
    honest = _masked_evaluation_plan(digest, sites)
    source: dict[str, Any] = {
        "state_dir": state,
        "server_public_key": public_key_to_raw(server.public_key()),
        "federation_id": FEDERATION,
    }
    assert evaluation_problem(honest, **source) == ""
    for site in sites:
        decision = check_plan(honest, site_id=site, policy=LocalPolicy(), supported_modes=mask)
        assert decision.accept, decision.reason
        assert set(decision.survivor_floors.values()) == {3}
    # the survivor floor: a histogram unmasked with one survivor would be one site's own
    lowered = _masked_evaluation_plan(digest, sites)
    lowered.releases[0].encoding.fixed_point.min_survivors = 1
    decision = check_plan(lowered, site_id="s1", policy=LocalPolicy(), supported_modes=mask)
    assert not decision.accept
    assert decision.reason.startswith(
        f"release {lowered.releases[0].name} would be unmasked with 1 surviving member(s)"
    )
    # an evaluation of the same model over every site but s4, after the one over all: s4's
    # counts are the difference; s4 never sees that plan, so the sites of the plan refuse it
    history = audit_view(honest.releases, tag="e2-m/")
    fewer = _masked_evaluation_plan(digest, sites[:3])
    for site in sites[:3]:
        decision = check_plan(
            fewer, site_id=site, policy=LocalPolicy(), history=history, supported_modes=mask
        )
        assert not decision.accept
        assert re.match(
            r"with the evaluations this site took part in, the plan determines the "
            r"(eval\[[AB]\]@[0-9a-f]{64}|labels\[[AB]\]) sum of \{s4\} by differencing",
            decision.reason,
        ), decision.reason
    assert check_plan(fewer, site_id="s1", policy=LocalPolicy(), supported_modes=mask).accept
    # the peer rule counts the rounds whose sums may have been released, i.e. that this site
    # uploaded to (the daemon's record): a plan accepted, then aborted at plan review because
    # s4 refused, released nothing, and its re-plan without s4 exposes no one
    store = DaemonState(tmp_path / "site-state")
    store.remember(honest)
    store.write_report(_aborted("e2-m", bytes_sent=0))
    assert store.uploaded_rounds() == set()
    peers = store.history(exclude_round="e2-n", only=store.uploaded_rounds())
    everything = store.history(exclude_round="e2-n")  # what the site's own exposure is audited with
    assert everything and not peers
    replan = check_plan(
        fewer,
        site_id="s1",
        policy=LocalPolicy(),
        history=everything,
        peer_history=peers,
        supported_modes=mask,
    )
    assert replan.accept, replan.reason
    store.write_report(_aborted("e2-m", bytes_sent=4096))
    assert store.uploaded_rounds() == {"e2-m"}  # e.g. aborted after the exchange
    peers = store.history(exclude_round="e2-n", only=store.uploaded_rounds())
    decision = check_plan(
        fewer,
        site_id="s1",
        policy=LocalPolicy(),
        history=peers,
        peer_history=peers,
        supported_modes=mask,
    )
    assert not decision.accept and "sum of {s4} by differencing" in decision.reason
    # and a two-site evaluation is below every site's min cohort
    pair = _masked_evaluation_plan(digest, sites[:2])
    decision = check_plan(pair, site_id="s1", policy=LocalPolicy(), supported_modes=mask)
    assert not decision.accept and "< min cohort 3" in decision.reason
