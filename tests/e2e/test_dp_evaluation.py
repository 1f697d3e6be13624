"""A DP run's evaluation round through the daemons (docs/protocol.md §6.1, §7): afl-server with
``[round.dp] eval_epsilon`` and ``evaluate = true``, four afl-client processes over loopback mutual
TLS, in ``mask`` and in ``ckks`` (with a decryptor). The scenario is tests/e2e/dp_scenario.py's
(patient level, m = 2 images per patient, t = 2 = the sites' default colluder floor ⌈4/3⌉).

* the evaluation plan states ε = ``eval_epsilon`` per site and the run's composed ε; each site's
  lifetime ledger records the round with that ε, which equals the independent analytic-Gaussian
  accountant of tests/helpers/dp_oracle.py (Balle & Wang 2018) over the plan's (Δ, σ);
* a coordinator that publishes a crafted W (columns e_0, e_3: two raw features) as the run's
  model and evaluates it on the fine default grid learns what the stated ε allows and no more
  (:func:`test_a_crafted_model_learns_no_more_than_the_stated_epsilon_allows`);
* the score bins are the DP bins (equal-mass bins of N(0, s²) and 0, s from the run's noisy Gram
  and sums), the released sums carry noise (they differ from the exact counts of the unit's rows)
  and the pooled AUC is within the test's stated tolerance of scikit-learn's ``roc_auc_score`` on
  the pooled rows (tolerance: the binning error plus 6 standard deviations of the noisy AUC to
  first order, :func:`_auc_tolerance`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from sklearn.metrics import roc_auc_score

from afl.client.config import load_client_config
from afl.client.policy.ledger import DpLedger
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS
from afl.lab.demo.federation import (
    LoopbackFederation,
    LoopbackRun,
    ckks_round_settings,
    mask_round_settings,
    prepare_loopback,
    run_loopback,
)
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import load_config
from tests.adversarial import malicious_server
from tests.e2e.dp_scenario import (
    CLASSES,
    DELTA,
    DP_TABLE,
    IMAGES_PER_PATIENT,
    D,
    add_dp_table,
    kept_unit_rows,
    signed_plans,
)
from tests.helpers import dp_oracle

SITES = ["site-1", "site-2", "site-3", "site-4"]
TOLERATED = 2  # the sites' default colluder floor ⌈4/3⌉ (M-126)
EVAL_EPSILON = 2.0
ROWS = 3000


def _data() -> tuple[list[NDArray[np.float32]], list[NDArray[np.int8]], list[list[str]]]:
    """dp_scenario's sites (features N(0, 1.5² I), y_c = [h_c + N(0, 1) > 1], three images per
    patient) with 3,000 rows or more each: the pooled AUC's noise shrinks like 1/rows."""
    rng = np.random.default_rng(5)
    feats, labels, patients = [], [], []
    for site in range(len(SITES)):
        n = ROWS + 60 * site
        h = rng.normal(size=(n, D)) * 1.5
        labels.append((h[:, :2] + rng.normal(size=(n, 2)) > 1.0).astype(np.int8))
        feats.append(h.astype(np.float32))
        patients.append([f"site{site}-patient{i // 3}" for i in range(n)])
    return feats, labels, patients


def _run(
    root: Path,
    mode: str,
    *,
    eval_epsilon: float = EVAL_EPSILON,
    server_command: tuple[str, ...] | None = None,
) -> tuple[LoopbackFederation, LoopbackRun]:
    feats, labels, patients = _data()
    settings: dict[str, Any] = {"gram_scope": "global", "upload_timeout_s": 120.0}
    dp: dict[str, Any] = {**DP_TABLE, "tolerated": TOLERATED, "eval_epsilon": eval_epsilon}
    if mode == "mask":
        settings.update(mask_round_settings(feats))
    else:
        settings.update(ckks_round_settings(feats))
        dp["max_samples"] = int(max(len(f) for f in feats) * 1.05)
    settings["evaluate"] = True
    loop = prepare_loopback(
        root,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        active=np.ones((len(SITES), len(CLASSES)), dtype=bool),
        test_features=feats[0][:30],
        test_labels=labels[0][:30],
        round_settings=settings,
        decryptor=mode == "ckks",
        site_patients=patients,
    )
    add_dp_table(loop.server_config, dp)
    run = run_loopback(loop, timeout_s=600, server_command=server_command)
    assert all(run.client_rcs[s] == 0 for s in SITES), run.logs
    return loop, run


@pytest.fixture(scope="module", params=["mask", "ckks"])
def dp_evaluated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    mode = str(request.param)
    loop, run = _run(tmp_path_factory.mktemp(f"dp-eval-{mode}"), mode)
    config = load_config(loop.server_config)
    plans = signed_plans(loop.server_config)
    (evaluation_plan,) = [p for p in plans.values() if p.round_number == 2]
    (model_file,) = (config.state_dir / "models").glob("*.signed-model.pb")
    (evaluation_file,) = (config.state_dir / "evaluations").glob("*.signed-evaluation.pb")
    model = pb.Model.FromString(pb.SignedModel.FromString(model_file.read_bytes()).model)
    signed = pb.SignedEvaluation.FromString(evaluation_file.read_bytes())
    return {
        "mode": mode,
        "loop": loop,
        "run": run,
        "plan": evaluation_plan,
        "weights": np.frombuffer(model.weights.data, dtype="<f8").reshape(
            tuple(model.weights.shape)
        ),
        "evaluation": pb.Evaluation.FromString(signed.evaluation),
    }


def _unit_rows(root: Path) -> tuple[NDArray[np.float64], NDArray[np.int8]]:
    """The rows the sites evaluate under DP: the first m images of every patient, pooled."""
    return kept_unit_rows(root, SITES)


def _binned_auc(neg: NDArray[np.float64], pos: NDArray[np.float64]) -> float:
    """Mann-Whitney AUC of binned scores, ties counted half (written out here)."""
    total = 0.0
    for j in range(len(neg)):
        total += neg[j] * (pos[j + 1 :].sum() + 0.5 * pos[j])
    return float(total / (pos.sum() * neg.sum()))


def _auc_tolerance(
    exact: float, neg: NDArray[np.float64], pos: NDArray[np.float64], sd: float
) -> float:
    """|AUC(noisy) − exact AUC| ≤ |AUC(binned) − exact| + 1.25·5·sd·‖∇AUC‖₂: the binning error,
    and 5 standard deviations of the noisy AUC to first order (each bin's count moves by
    N(0, sd²), independently; ∇ by central differences, P(|N(0, 1)| > 5) < 6e-7), with 25 % for
    the second-order terms."""
    base = _binned_auc(neg, pos)
    grad = []
    for arr in (neg, pos):
        for j in range(len(arr)):
            up, down = arr.copy(), arr.copy()
            up[j] += 0.5
            down[j] -= 0.5
            args_up = (up, pos) if arr is neg else (neg, up)
            args_down = (down, pos) if arr is neg else (neg, down)
            grad.append(_binned_auc(*args_up) - _binned_auc(*args_down))
    return abs(base - exact) + 1.25 * 5 * sd * float(np.linalg.norm(grad))


def test_a_dp_evaluation_round_costs_its_stated_epsilon_in_every_sites_ledger(
    dp_evaluated: Any,
) -> None:
    plan: cpb.ReleasePlan = dp_evaluated["plan"]
    loop: LoopbackFederation = dp_evaluated["loop"]
    assert plan.dp.enabled and plan.dp.epsilon == EVAL_EPSILON and plan.dp.delta == DELTA
    assert {r.kind for r in plan.releases} == {
        cpb.STATISTIC_KIND_SCORE_HISTOGRAM,
        cpb.STATISTIC_KIND_CONFUSION_COUNTS,
    }
    delta_l2 = IMAGES_PER_PATIENT * math.sqrt(len(CLASSES))  # m·√C
    assert all(math.isclose(r.noise.sensitivity, delta_l2, rel_tol=1e-9) for r in plan.releases)
    assert all(r.noise.assumed_colluders == TOLERATED for r in plan.releases)
    oracle = dp_oracle.epsilon(
        dp_oracle.composed_mu([(delta_l2, r.noise.sigma) for r in plan.releases]), DELTA
    )
    assert math.isclose(oracle, EVAL_EPSILON, rel_tol=1e-6)
    for site in SITES:
        (budget,) = [b for b in plan.budgets if b.site_id == site]
        assert math.isclose(budget.epsilon, oracle, rel_tol=1e-6)
        state = load_client_config(loop.client_configs[site]).state_dir
        entry = DpLedger(state / "dp-ledger").entry_for(plan.round_id)
        assert entry is not None, site
        assert math.isclose(entry.epsilon, oracle, rel_tol=1e-6), (site, entry.epsilon)
        assert entry.run_id == plan.run_id


def test_the_noisy_pooled_auc_is_within_the_stated_tolerance_of_the_exact_one(
    dp_evaluated: Any,
) -> None:
    plan: cpb.ReleasePlan = dp_evaluated["plan"]
    evaluation: pb.Evaluation = dp_evaluated["evaluation"]
    document = json.loads(evaluation.evaluation_json)
    assert document["dp"]["epsilon"] == EVAL_EPSILON
    (hist,) = [r for r in plan.releases if r.kind == cpb.STATISTIC_KIND_SCORE_HISTOGRAM]
    edges = np.asarray(hist.evaluation.score_bin_edges)
    assert 0.0 in edges and len(edges) <= 20  # the DP bins, not the fine default grid
    h, y = _unit_rows(dp_evaluated["loop"].root)
    z = h @ dp_evaluated["weights"]
    n, t = len(SITES), hist.noise.assumed_colluders
    sd = hist.noise.sigma / math.sqrt(n - t) * math.sqrt(n)  # n shares of σ/√(n − t)
    released, exact_counts = [], []
    for c, name in enumerate(CLASSES):
        exact = float(roc_auc_score(y[:, c], z[:, c]))
        index = np.searchsorted(edges, z[:, c], side="left")
        neg = np.bincount(index[y[:, c] == 0], minlength=len(edges) + 1).astype(np.float64)
        pos = np.bincount(index[y[:, c] == 1], minlength=len(edges) + 1).astype(np.float64)
        got = document["per_class"][name]["auc"]
        tol = _auc_tolerance(exact, neg, pos, sd)
        assert tol < 0.06, tol  # the tolerance says something at this ε and size
        assert abs(got - exact) <= tol, (name, got, exact, tol)
        released.append(
            (document["per_class"][name]["n_pos"], document["per_class"][name]["n_neg"])
        )
        exact_counts.append((int(pos.sum()), int(neg.sum())))
    # the released counts carry noise: the four totals (each a sum of 16 or 17 noisy bins) are
    # not all the exact ones (each matches with probability < 0.03)
    assert released != exact_counts


CRAFTED_EPSILON = 1.0


def test_a_crafted_model_learns_no_more_than_the_stated_epsilon_allows(tmp_path: Path) -> None:
    """M-213. The coordinator publishes, validly signed, W = [e_0, e_3] as the run's model and
    runs the DP evaluation round on the fine default grid (1,284 bins: without noise most tail
    bins would hold one row, revealing its raw feature value with its label). The sites score it
    (they verified it: M-94 alone cannot tell) and what the coordinator unmasks is noised.

    The bound, stated: the round is μ-GDP for every unit, μ = √Σ(Δ/σ_r)² (= 1/z* at ε = 1,
    δ = 1e-6), so any test between "this bin holds c rows" and "c − 1" (one row removed: a
    neighbouring data set) has TPR − FPR ≤ 2Φ(μ/2) − 1 (Dong, Roth & Su 2019). The attacker who
    knows every other row reads the bin's count exactly iff the noise e satisfies −½ ≤ e < ½,
    which is that test's TPR − FPR; the fraction of bins (and of the bins holding one row: the
    per-row values) it reads exactly must stay below the bound (plus 4 binomial standard
    deviations over the bins counted). Without noise both fractions are 1."""
    loot = tmp_path / "loot.json"
    loop, _ = _run(
        tmp_path / "fed",
        "mask",
        eval_epsilon=CRAFTED_EPSILON,
        server_command=malicious_server.command("crafted-model-dp", loot),
    )
    (plan,) = [p for p in signed_plans(loop.server_config).values() if p.round_number == 2]
    assert plan.dp.enabled and plan.dp.epsilon == CRAFTED_EPSILON
    (hist,) = [r for r in plan.releases if r.kind == cpb.STATISTIC_KIND_SCORE_HISTOGRAM]
    edges = np.asarray(hist.evaluation.score_bin_edges)
    assert len(edges) == DEFAULT_SCORE_BINS.num_bins - 1  # the attacker's fine grid
    released = np.asarray(json.loads(loot.read_text())[hist.name]).reshape(len(CLASSES), 2, -1)
    h, y = _unit_rows(loop.root)
    exact = np.zeros_like(released)
    for c, feature in enumerate(malicious_server.CRAFTED_FEATURES):
        index = np.searchsorted(edges, h[:, feature], side="left")  # bin j: (e_{j-1}, e_j]
        for label in (0, 1):
            exact[c, label] = np.bincount(index[y[:, c] == label], minlength=len(edges) + 1)
    singles = exact == 1
    assert singles.sum() > 100  # without noise: > 100 rows' raw values, each with its label
    noise = (released - exact).ravel()
    n, t = len(SITES), hist.noise.assumed_colluders
    sd = hist.noise.sigma / math.sqrt(n - t) * math.sqrt(n)
    assert 0.9 < float(np.std(noise)) / sd < 1.1  # the stated noise, in every bin
    mu = dp_oracle.composed_mu([(r.noise.sensitivity, r.noise.sigma) for r in plan.releases])
    assert math.isclose(dp_oracle.epsilon(mu, DELTA), CRAFTED_EPSILON, rel_tol=1e-6)
    bound = 2 * _phi(mu / 2) - 1
    read = (noise >= -0.5) & (noise < 0.5)
    for name, hits in (("bins", read), ("single rows", read[singles.ravel()])):
        slack = 4 * math.sqrt(bound * (1 - bound) / hits.size)
        assert float(hits.mean()) <= bound + slack, (name, float(hits.mean()), bound)
    # what the attacker does read is what the stated σ predicts (P(|e| < ½) for N(0, sd²))
    assert float(read.mean()) <= 2 * (2 * _phi(0.5 / sd) - 1) + 0.01


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))
