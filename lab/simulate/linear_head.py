"""A linear multi-label head trained by minibatch gradient descent on frozen features.

The local objective of the gradient baselines (``afl.lab.simulate.baselines``) at one site, for a batch
``B`` of rows with features ``x_i`` and 0/1 targets ``y_ic``::

    L(W, b) = (1/|B|) Σ_{i∈B} Σ_c m_c · BCE(σ(x_i·w_c + b_c), y_ic)  +  (μ/2) ‖θ − θ_g‖²

with ``BCE(p, y) = −y log p − (1−y) log(1−p)``, ``θ = (W, b)``, ``θ_g`` the global model the
round started from (FedProx's proximal term; μ = 0 gives FedAvg) and ``m_c`` the class mask
(1 for every class when missing labels are treated as negatives, the site's active classes
when they are masked out). Summing over classes and averaging over rows keeps each class's
gradient equal to its own mean-BCE gradient, so masking one class never rescales another::

    ∂L/∂W = Xᵀ((σ(XW + b) − Y) ⊙ m) / |B| + μ (W − W_g),   ∂L/∂b = 1ᵀ(...) / |B| + μ (b − b_g)

Optimisers: Adam (Kingma & Ba 2015, bias-corrected; its state starts afresh every local
epoch, as a client that builds a new optimiser each round does) or plain SGD.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray
from scipy.special import expit

Optimiser = Literal["adam", "sgd"]
OPTIMISERS: tuple[Optimiser, ...] = ("adam", "sgd")
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


@dataclass
class LinearHead:
    """Weights ``W`` (d, C) and bias ``b`` (C,), float64."""

    weights: NDArray[np.float64]
    bias: NDArray[np.float64]

    @classmethod
    def zeros(cls, d: int, num_classes: int) -> LinearHead:
        """The initial model: all zeros (the objective is convex; no random init needed)."""
        return cls(np.zeros((d, num_classes)), np.zeros(num_classes))

    def copy(self) -> LinearHead:
        return LinearHead(self.weights.copy(), self.bias.copy())

    @property
    def num_parameters(self) -> int:
        return int(self.weights.size + self.bias.size)

    def logits(self, features: NDArray[np.floating]) -> NDArray[np.float64]:
        """``X W + b`` in float64."""
        x = np.asarray(features, dtype=np.float64)
        out: NDArray[np.float64] = x @ self.weights + self.bias
        return out

    def predict_proba(
        self, features: NDArray[np.floating], *, batch_size: int = 8192
    ) -> NDArray[np.float64]:
        """``σ(X W + b)`` for a (memory-mapped) feature matrix, in row blocks."""
        out = np.empty((features.shape[0], self.weights.shape[1]), dtype=np.float64)
        for start in range(0, features.shape[0], batch_size):
            out[start : start + batch_size] = expit(
                self.logits(features[start : start + batch_size])
            )
        return out


def bce_loss(
    head: LinearHead,
    features: NDArray[np.floating],
    targets: NDArray[np.floating],
    mask: NDArray[np.float64],
    *,
    batch_size: int = 8192,
) -> float:
    """``(1/N) Σ_i Σ_c m_c BCE(σ(z_ic), y_ic)`` with ``BCE = log(1 + e^z) − y z`` (stable form)."""
    total = 0.0
    n = int(features.shape[0])
    for start in range(0, n, batch_size):
        z = head.logits(features[start : start + batch_size])
        y = np.asarray(targets[start : start + batch_size], dtype=np.float64)
        total += float(((np.logaddexp(0.0, z) - y * z) * mask).sum())
    return total / max(n, 1)


def local_epoch(
    head: LinearHead,
    *,
    anchor: LinearHead,
    features: NDArray[np.floating],
    targets: NDArray[np.floating],
    mask: NDArray[np.float64],
    order: NDArray[np.int64],
    lr: float,
    batch_size: int,
    mu: float,
    optimiser: Optimiser,
) -> tuple[LinearHead, float]:
    """One pass over the rows in ``order`` (module docstring's objective) starting from ``head``
    with proximal anchor θ_g = ``anchor``; returns the trained head (a new object, the inputs are
    left unchanged) and the mean BCE of the minibatches seen (each before its step)."""
    if optimiser not in OPTIMISERS:
        raise ValueError(f"unknown optimiser {optimiser!r}; choose one of {OPTIMISERS}")
    w, b = head.weights.copy(), head.bias.copy()
    m_w, v_w = np.zeros_like(w), np.zeros_like(w)
    m_b, v_b = np.zeros_like(b), np.zeros_like(b)
    beta1, beta2 = ADAM_BETAS
    # One gather per epoch (contiguous minibatch slices after it), converted to float64 once.
    x_all = np.asarray(features[order], dtype=np.float64)
    y_all = np.asarray(targets[order], dtype=np.float64)
    loss_sum, steps = 0.0, 0
    for start in range(0, x_all.shape[0], batch_size):
        x = x_all[start : start + batch_size]
        y = y_all[start : start + batch_size]
        z = x @ w + b
        loss_sum += float(((np.logaddexp(0.0, z) - y * z) * mask).sum()) / x.shape[0]
        residual = (expit(z) - y) * (mask / x.shape[0])
        g_w = x.T @ residual
        g_b = residual.sum(axis=0)
        if mu:
            g_w += mu * (w - anchor.weights)
            g_b += mu * (b - anchor.bias)
        steps += 1
        if optimiser == "sgd":
            w -= lr * g_w
            b -= lr * g_b
            continue
        m_w = beta1 * m_w + (1 - beta1) * g_w
        v_w = beta2 * v_w + (1 - beta2) * g_w * g_w
        m_b = beta1 * m_b + (1 - beta1) * g_b
        v_b = beta2 * v_b + (1 - beta2) * g_b * g_b
        step = lr * np.sqrt(1 - beta2**steps) / (1 - beta1**steps)
        w -= step * m_w / (np.sqrt(v_w) + ADAM_EPS)
        b -= step * m_b / (np.sqrt(v_b) + ADAM_EPS)
    return LinearHead(w, b), loss_sum / max(steps, 1)
