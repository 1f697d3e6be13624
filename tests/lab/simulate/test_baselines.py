"""Gradient baselines: loss, missing-label treatments, FedProx, determinism, traffic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray
from scipy.special import expit

from afl.lab.simulate.baselines import (
    BASELINES,
    BaselineConfig,
    BaselineError,
    communication,
    federated_objective,
    run_baseline,
    site_targets,
)
from afl.lab.simulate.linear_head import LinearHead, bce_loss, local_epoch

K, C, D, N = 3, 4, 12, 90
FAST = BaselineConfig(rounds=8, lr=0.05, batch_size=16, mu=0.1, seed=3)


def _data(
    seed: int = 0,
) -> tuple[list[NDArray[np.float32]], list[NDArray[np.int8]], NDArray[np.bool_]]:
    """Three sites, four classes; features carry a linear signal for every class."""
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=(D, C))
    feats, labels = [], []
    for k in range(K):
        x = rng.normal(loc=0.2 * k, size=(N + 7 * k, D)).astype(np.float32)
        y = (x @ direction + rng.normal(scale=0.5, size=(x.shape[0], C)) > 0.3).astype(np.int8)
        feats.append(x)
        labels.append(y)
    active = np.array(
        [[True, True, False, False], [False, True, True, False], [True, False, False, True]]
    )
    return feats, labels, active


def _run(name: str, labels: list[NDArray[np.int8]] | None = None, **overrides: float) -> LinearHead:
    feats, default_labels, active = _data()
    cfg = BaselineConfig(**{**FAST.__dict__, **overrides})
    result = run_baseline(
        name,
        site_features=feats,
        site_labels=default_labels if labels is None else labels,
        active=active,
        config=cfg,
    )
    return result.head


def _flip_inactive(
    labels: list[NDArray[np.int8]], active: NDArray[np.bool_]
) -> list[NDArray[np.int8]]:
    out = [y.copy() for y in labels]
    for k, y in enumerate(out):
        y[:, ~active[k]] = 1 - y[:, ~active[k]]
    return out


@pytest.mark.parametrize("optimiser", ["sgd", "adam"])
@pytest.mark.parametrize("name", ["fedavg", "fedavg-masked"])
def test_training_decreases_the_federated_objective(name: str, optimiser: str) -> None:
    feats, labels, active = _data()
    masked = name.endswith("-masked")
    start = federated_objective(
        LinearHead.zeros(D, C),
        site_features=feats,
        site_labels=labels,
        active=active,
        masked=masked,
    )
    cfg = BaselineConfig(**{**FAST.__dict__, "optimiser": optimiser})
    result = run_baseline(name, site_features=feats, site_labels=labels, active=active, config=cfg)
    end = federated_objective(
        result.head, site_features=feats, site_labels=labels, active=active, masked=masked
    )
    assert end < 0.8 * start
    assert result.loss_history[-1] < result.loss_history[0]


def test_masked_ignores_labels_of_inactive_classes() -> None:
    _, labels, active = _data()
    base = _run("fedavg-masked")
    flipped = _run("fedavg-masked", labels=_flip_inactive(labels, active))
    np.testing.assert_array_equal(base.weights, flipped.weights)
    np.testing.assert_array_equal(base.bias, flipped.bias)


def test_negatives_never_read_inactive_labels_either() -> None:
    """fedavg uses 0 for missing labels, never the hidden truth."""
    _, labels, active = _data()
    np.testing.assert_array_equal(
        _run("fedavg").weights, _run("fedavg", labels=_flip_inactive(labels, active)).weights
    )


def test_fedavg_treats_missing_labels_as_negatives() -> None:
    """Equal to masked training on labels where the missing entries are set to 0 and marked
    active; different from the masked treatment."""
    feats, labels, active = _data()
    zeroed = [np.where(active[k], y, 0).astype(np.int8) for k, y in enumerate(labels)]
    as_negatives = run_baseline(
        "fedavg-masked",
        site_features=feats,
        site_labels=zeroed,
        active=np.ones_like(active),
        config=FAST,
    ).head
    fedavg = _run("fedavg")
    np.testing.assert_allclose(fedavg.weights, as_negatives.weights, rtol=1e-12, atol=1e-14)
    assert not np.allclose(fedavg.weights, _run("fedavg-masked").weights)
    # Class 3 is labelled only at site 2: negatives at the other sites pull its bias down.
    assert fedavg.bias[3] < _run("fedavg-masked").bias[3]


@pytest.mark.parametrize(
    ("prox", "avg"), [("fedprox", "fedavg"), ("fedprox-masked", "fedavg-masked")]
)
def test_fedprox_with_zero_mu_is_fedavg(prox: str, avg: str) -> None:
    a, b = _run(prox, mu=0.0), _run(avg)
    np.testing.assert_array_equal(a.weights, b.weights)
    np.testing.assert_array_equal(a.bias, b.bias)
    assert not np.array_equal(_run(prox, mu=1.0).weights, b.weights)


def test_proximal_term_keeps_local_models_near_the_anchor() -> None:
    feats, labels, active = _data()
    targets, mask = site_targets(labels[0], active[0], masked=False)
    anchor = LinearHead.zeros(D, C)
    order = np.arange(feats[0].shape[0])
    kwargs = dict(features=feats[0], targets=targets, mask=mask, order=order, lr=0.05, batch_size=8)
    free, _ = local_epoch(anchor, anchor=anchor, mu=0.0, optimiser="sgd", **kwargs)  # type: ignore[arg-type]
    tied, _ = local_epoch(anchor, anchor=anchor, mu=5.0, optimiser="sgd", **kwargs)  # type: ignore[arg-type]
    assert np.linalg.norm(tied.weights) < np.linalg.norm(free.weights)


@pytest.mark.parametrize("name", BASELINES)
def test_deterministic_for_a_seed(name: str) -> None:
    np.testing.assert_array_equal(_run(name).weights, _run(name).weights)
    assert not np.array_equal(_run(name).weights, _run(name, seed=4).weights)


def test_gradient_matches_finite_differences() -> None:
    """One SGD step of size lr on one full batch equals θ − lr ∇L with ∇L from central
    differences of the documented objective (an independent oracle for the analytic gradient)."""
    feats, labels, active = _data()
    x = feats[1][:20].astype(np.float64)
    targets, mask = site_targets(labels[1][:20], active[1], masked=True)
    rng = np.random.default_rng(1)
    head = LinearHead(rng.normal(scale=0.1, size=(D, C)), rng.normal(scale=0.1, size=C))
    anchor = LinearHead(rng.normal(scale=0.1, size=(D, C)), rng.normal(scale=0.1, size=C))
    mu, lr = 0.3, 1e-3

    def objective(w: NDArray[np.float64], b: NDArray[np.float64]) -> float:
        prox = 0.5 * mu * (((w - anchor.weights) ** 2).sum() + ((b - anchor.bias) ** 2).sum())
        return bce_loss(LinearHead(w, b), x, targets, mask) + float(prox)

    grad_w = np.zeros_like(head.weights)
    eps = 1e-6
    for idx in np.ndindex(*head.weights.shape):
        up, down = head.weights.copy(), head.weights.copy()
        up[idx] += eps
        down[idx] -= eps
        grad_w[idx] = (objective(up, head.bias) - objective(down, head.bias)) / (2 * eps)
    stepped, _ = local_epoch(
        head,
        anchor=anchor,
        features=x,
        targets=targets,
        mask=mask,
        order=np.arange(20),
        lr=lr,
        batch_size=20,
        mu=mu,
        optimiser="sgd",
    )
    np.testing.assert_allclose(stepped.weights, head.weights - lr * grad_w, rtol=0, atol=1e-10)
    assert np.all(
        stepped.weights[:, ~active[1]]
        == head.weights[:, ~active[1]]
        - lr * mu * (head.weights[:, ~active[1]] - anchor.weights[:, ~active[1]])
    )


def test_predict_proba_is_sigmoid_of_affine_scores() -> None:
    feats, _, _ = _data()
    head = _run("fedavg")
    x = feats[0].astype(np.float64)
    np.testing.assert_allclose(
        head.predict_proba(feats[0], batch_size=7), expit(x @ head.weights + head.bias), rtol=1e-12
    )


def test_communication_for_a_known_shape() -> None:
    comm = communication(d=1024, num_classes=8, rounds=50, bytes_per_param=4)
    assert comm["parameters"] == 8200
    assert comm["bytes_up_per_site"] == 50 * 8200 * 4 == 1_640_000
    assert comm["bytes_down_per_site"] == 51 * 8200 * 4
    feats, labels, active = _data()
    result = run_baseline(
        "fedprox", site_features=feats, site_labels=labels, active=active, config=FAST
    )
    assert result.communication["rounds"] == FAST.rounds
    assert result.communication["bytes_up_per_site"] == FAST.rounds * (D * C + C) * 4
    assert result.seconds > 0
    assert result.to_json()["config"]["missing_labels"] == "negative"


@settings(max_examples=25, deadline=None)
@given(
    d=st.integers(1, 4096),
    c=st.integers(1, 64),
    rounds=st.integers(1, 500),
    nbytes=st.sampled_from([2, 4, 8]),
)
def test_communication_is_linear_in_rounds(d: int, c: int, rounds: int, nbytes: int) -> None:
    comm = communication(d=d, num_classes=c, rounds=rounds, bytes_per_param=nbytes)
    one = communication(d=d, num_classes=c, rounds=1, bytes_per_param=nbytes)
    assert comm["bytes_up_per_site"] == rounds * one["bytes_up_per_site"]
    assert comm["bytes_down_per_site"] - comm["bytes_up_per_site"] == one["bytes_up_per_site"]


@pytest.mark.parametrize(
    "overrides", [{"rounds": 0}, {"lr": 0.0}, {"mu": -1.0}, {"optimiser": "rmsprop"}]
)
def test_bad_config_is_rejected(overrides: dict[str, object]) -> None:
    with pytest.raises(BaselineError):
        BaselineConfig(**overrides)  # type: ignore[arg-type]


def test_bad_inputs_are_rejected() -> None:
    feats, labels, active = _data()
    with pytest.raises(BaselineError, match="unknown baseline"):
        run_baseline("fedsgd", site_features=feats, site_labels=labels, active=active)
    with pytest.raises(BaselineError, match="active must be"):
        run_baseline("fedavg", site_features=feats, site_labels=labels, active=active[:2])
    with pytest.raises(BaselineError, match="do not match"):
        run_baseline(
            "fedavg", site_features=feats, site_labels=[y[:, :2] for y in labels], active=active
        )
    bad = [y.copy() for y in labels]
    bad[0][0, 0] = 2
    with pytest.raises(BaselineError, match="0/1"):
        run_baseline("fedavg", site_features=feats, site_labels=bad, active=active)


def test_one_round_is_the_size_weighted_average_of_local_models() -> None:
    """FedAvg's server step: θ = Σ_k n_k θ_k / Σ_k n_k (sites of 90, 97 and 104 rows).
    Full-batch local steps make each θ_k independent of the shuffling."""
    feats, labels, active = _data()
    cfg = BaselineConfig(rounds=1, lr=0.05, batch_size=1000, mu=0.0)
    result = run_baseline(
        "fedavg-masked", site_features=feats, site_labels=labels, active=active, config=cfg
    )
    zero = LinearHead.zeros(D, C)
    sizes = np.array([x.shape[0] for x in feats], dtype=np.float64)
    expected = np.zeros((D, C))
    for k, x in enumerate(feats):
        targets, mask = site_targets(labels[k], active[k], masked=True)
        local, _ = local_epoch(
            zero,
            anchor=zero,
            features=x,
            targets=targets,
            mask=mask,
            order=np.arange(x.shape[0]),
            lr=0.05,
            batch_size=1000,
            mu=0.0,
            optimiser="sgd",
        )
        expected += sizes[k] / sizes.sum() * local.weights
    np.testing.assert_allclose(result.weights, expected, rtol=1e-10, atol=1e-14)
