"""Gradient FL baselines on the frozen features (paper §IV "Comparison Baseline Methods").

Every method trains the same linear head (weights (d, C) + bias (C,), per-class sigmoid BCE;
``afl.lab.simulate.linear_head``) from zeros for ``rounds`` rounds (paper: R = 50) of ``local_epochs``
local epochs (paper: 1) at every site, and the server averages the sites' models weighted by
their row counts (FedAvg, McMahan et al. 2017): ``θ ← Σ_k n_k θ_k / Σ_k n_k``.

Methods (how a site treats the classes it does NOT label, ``active[k, c] = False``):
- ``fedavg``: missing labels are negatives (target 0), the paper's FedAvg;
- ``fedavg-masked``: missing labels are masked out of the loss (zero gradient for that class's
  column at that site; the site returns the column unchanged, and the server's size-weighted
  average is the plain FedAvg one, so the server needs no knowledge of who labels what);
- ``fedprox`` / ``fedprox-masked``: FedProx (Li et al. 2020): the local objective adds
  ``(μ/2)‖θ − θ_g‖²``; ``fedprox`` treats missing labels as negatives like the paper's FedAvg
  (so the comparison isolates the proximal term), ``fedprox-masked`` masks them. μ = 0 gives
  exactly the corresponding FedAvg run.
The labels of an inactive class are read by no method: the targets are
``where(active, labels, 0)`` before any training.

Defaults (documented optimiser settings): plain minibatch SGD (the paper's "one epoch of local
SGD"), lr 0.1, batch size 64, no momentum or weight decay; μ = 0.01 (in FedProx's recommended
grid {0.001, 0.01, 0.1, 1}); seed 0 drives the per-round, per-site shuffling only (the init is
zero), so a run is a deterministic function of its inputs and config. The lr was chosen on the
TRAINING objective (``federated_objective``) of fedavg, Missing 1, surrogate default, among
{0.05, 0.1, 0.2} (1.390 / 1.362 / 1.426 after 50 rounds); Adam (lr 1e-4 … 1e-2, state reset
every round) ended at 1.65-2.02 there (client drift of its sign-like first steps) and is kept
as ``optimiser="adam"``. Never tuned on test metrics.

Communication (computed, not measured): each round a site downloads the global model and
uploads its local model, ``P = d·C + C`` parameters of ``bytes_per_param`` bytes (4: float32,
as a framework's state dict would ship them). Downloads are ``rounds + 1`` (the model for each
round plus the final model), uploads ``rounds``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray
from tqdm import tqdm

from afl.lab.simulate.linear_head import OPTIMISERS, LinearHead, Optimiser, bce_loss, local_epoch

BASELINES: tuple[str, ...] = ("fedavg", "fedavg-masked", "fedprox", "fedprox-masked")


class BaselineError(ValueError):
    """A baseline name, configuration or input is invalid."""


@dataclass(frozen=True)
class BaselineConfig:
    """Optimiser and schedule of the gradient baselines (module docstring)."""

    rounds: int = 50
    local_epochs: int = 1
    lr: float = 0.1
    batch_size: int = 64
    mu: float = 0.01
    seed: int = 0
    optimiser: Optimiser = "sgd"
    bytes_per_param: int = 4

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.local_epochs < 1 or self.batch_size < 1:
            raise BaselineError("rounds, local_epochs and batch_size must be >= 1")
        if not (self.lr > 0 and np.isfinite(self.lr)):
            raise BaselineError(f"lr must be positive and finite, got {self.lr}")
        if not (self.mu >= 0 and np.isfinite(self.mu)):
            raise BaselineError(f"mu must be >= 0 and finite, got {self.mu}")
        if self.optimiser not in OPTIMISERS:
            raise BaselineError(f"unknown optimiser {self.optimiser!r}; choose one of {OPTIMISERS}")
        if self.bytes_per_param not in (2, 4, 8):
            raise BaselineError(f"bytes_per_param must be 2, 4 or 8, got {self.bytes_per_param}")


@dataclass(frozen=True)
class BaselineResult:
    """The trained global head, its training trace and its communication accounting."""

    name: str
    head: LinearHead
    communication: dict[str, int]
    seconds: float
    loss_history: tuple[float, ...]
    config: BaselineConfig = field(default_factory=BaselineConfig)

    @property
    def weights(self) -> NDArray[np.float64]:
        return self.head.weights

    @property
    def bias(self) -> NDArray[np.float64]:
        return self.head.bias

    def predict_proba(self, features: NDArray[np.floating]) -> NDArray[np.float64]:
        """``σ(X W + b)``, (N, C) float64."""
        return self.head.predict_proba(features)

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.name,
            "communication": dict(self.communication),
            "seconds": self.seconds,
            "final_local_loss": self.loss_history[-1] if self.loss_history else None,
            "config": {
                "rounds": self.config.rounds,
                "local_epochs": self.config.local_epochs,
                "optimiser": self.config.optimiser,
                "lr": self.config.lr,
                "batch_size": self.config.batch_size,
                "mu": self.config.mu if self.name.startswith("fedprox") else 0.0,
                "seed": self.config.seed,
                "missing_labels": "masked" if self.name.endswith("-masked") else "negative",
            },
        }


def communication(*, d: int, num_classes: int, rounds: int, bytes_per_param: int) -> dict[str, int]:
    """Per-site traffic of ``rounds`` rounds of model exchange (module docstring)."""
    params = d * num_classes + num_classes
    per_model = params * bytes_per_param
    return {
        "rounds": rounds,
        "parameters": params,
        "bytes_per_param": bytes_per_param,
        "uploads_per_site": rounds,
        "downloads_per_site": rounds + 1,
        "bytes_up_per_site": rounds * per_model,
        "bytes_down_per_site": (rounds + 1) * per_model,
    }


def _check_inputs(
    site_features: Sequence[NDArray[np.floating]],
    site_labels: Sequence[NDArray[np.integer]],
    active: NDArray[np.bool_],
) -> tuple[int, int]:
    if not site_features or len(site_features) != len(site_labels):
        raise BaselineError(
            f"need one label matrix per site: {len(site_features)} feature matrices, "
            f"{len(site_labels)} label matrices"
        )
    k = len(site_features)
    if active.ndim != 2 or active.shape[0] != k:
        raise BaselineError(f"active must be (K={k}, C), got {active.shape}")
    num_classes = active.shape[1]
    d = site_features[0].shape[1]
    for i, (x, y) in enumerate(zip(site_features, site_labels, strict=True)):
        if x.ndim != 2 or x.shape[1] != d or y.shape != (x.shape[0], num_classes):
            raise BaselineError(
                f"site {i}: features {x.shape} and labels {y.shape} do not match (N, {d}) and "
                f"(N, {num_classes})"
            )
        if x.shape[0] == 0:
            raise BaselineError(f"site {i} has no rows")
    return d, num_classes


def site_targets(
    labels: NDArray[np.integer], active_row: NDArray[np.bool_], *, masked: bool
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """A site's training targets and class mask: ``where(active, labels, 0)`` and ``m``.

    Inactive columns are never read: they are 0 (negatives) and, when ``masked``, also carry
    mask 0 so they contribute neither loss nor gradient.
    """
    targets = np.zeros(labels.shape, dtype=np.float64)
    targets[:, active_row] = labels[:, active_row]
    if not np.isin(targets, (0.0, 1.0)).all():
        raise BaselineError("labels of active classes must be 0/1")
    mask = active_row.astype(np.float64) if masked else np.ones(labels.shape[1])
    return targets, mask


def run_baseline(
    name: str,
    *,
    site_features: Sequence[NDArray[np.floating]],
    site_labels: Sequence[NDArray[np.integer]],
    active: NDArray[np.bool_],
    config: BaselineConfig | None = None,
    progress: bool = False,
) -> BaselineResult:
    """Train one baseline (module docstring) and return the global head after the last round."""
    if name not in BASELINES:
        raise BaselineError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
    cfg = config if config is not None else BaselineConfig()
    active = np.asarray(active, dtype=np.bool_)
    d, num_classes = _check_inputs(site_features, site_labels, active)
    masked = name.endswith("-masked")
    mu = cfg.mu if name.startswith("fedprox") else 0.0
    prepared = [
        site_targets(np.asarray(y), active[k], masked=masked) for k, y in enumerate(site_labels)
    ]
    sizes = np.array([x.shape[0] for x in site_features], dtype=np.float64)
    weights = sizes / sizes.sum()
    head = LinearHead.zeros(d, num_classes)
    history: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(cfg.rounds), disable=not progress, desc=name, unit="round", leave=False)
    for rnd in bar:
        new_w = np.zeros_like(head.weights)
        new_b = np.zeros_like(head.bias)
        round_loss = 0.0
        for k, (x, (targets, mask)) in enumerate(zip(site_features, prepared, strict=True)):
            local = head
            for epoch in range(cfg.local_epochs):
                # Independent stream per (seed, round, site, epoch): order-free determinism.
                rng = np.random.default_rng([cfg.seed, rnd, k, epoch])
                local, loss = local_epoch(
                    local,
                    anchor=head,
                    features=x,
                    targets=targets,
                    mask=mask,
                    order=rng.permutation(x.shape[0]),
                    lr=cfg.lr,
                    batch_size=cfg.batch_size,
                    mu=mu,
                    optimiser=cfg.optimiser,
                )
            round_loss += weights[k] * loss
            new_w += weights[k] * local.weights
            new_b += weights[k] * local.bias
        head = LinearHead(new_w, new_b)
        history.append(round_loss)
        bar.set_postfix(loss=f"{round_loss:.4f}")
    return BaselineResult(
        name=name,
        head=head,
        communication=communication(
            d=d, num_classes=num_classes, rounds=cfg.rounds, bytes_per_param=cfg.bytes_per_param
        ),
        seconds=time.perf_counter() - start,
        loss_history=tuple(history),
        config=cfg,
    )


def federated_objective(
    head: LinearHead,
    *,
    site_features: Sequence[NDArray[np.floating]],
    site_labels: Sequence[NDArray[np.integer]],
    active: NDArray[np.bool_],
    masked: bool,
) -> float:
    """The size-weighted global training objective ``Σ_k (n_k/n) L_k(θ)`` (μ-free), the quantity
    FedAvg minimises, with each site's documented treatment of its missing labels."""
    n = sum(x.shape[0] for x in site_features)
    total = 0.0
    for k, (x, y) in enumerate(zip(site_features, site_labels, strict=True)):
        targets, mask = site_targets(np.asarray(y), np.asarray(active[k], bool), masked=masked)
        total += x.shape[0] / n * bce_loss(head, x, targets, mask)
    return total
