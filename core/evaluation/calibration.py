"""Post-hoc per-class calibration of the head's scores into probabilities, fitted from score
histograms that sites can release under the round's protection (docs/method.md §3.3).

With balanced targets the head's scores ``z = h · w_c`` are tiny and σ(z) stays near 0.5 for every
image (docs/method.md §1.6): the paper's probabilities rank images but do not estimate a
frequency. A calibration maps z to an estimate of P(y = 1 | z) for class c. It is fitted from the
summed score histograms of :mod:`afl.core.evaluation.federated` (positives and negatives per plan-declared
bin, :mod:`afl.core.evaluation.scorebins`): every bin j stands for its representative score ``r_j`` with
``P_j`` positives and ``N_j`` negatives. No site reveals a per-image score, and because the fit
depends on the summed counts only, the federated fit equals a pooled fit on the same bins.

* ``platt`` (Platt 1999): ``p = σ(a z + b)``, maximising the binned log-likelihood
  ``Σ_j P_j log σ(a r_j + b) + N_j log(1 − σ(a r_j + b))``. The optimisation runs on
  standardised scores ``u = (r − m)/s`` (m, s the count-weighted mean and standard deviation of
  the representatives) with scipy's ``trust-exact`` Newton method on the exact gradient and
  Hessian; then ``a = α/s``, ``b = β − α m/s``.
* ``isotonic``: the non-decreasing step function minimising ``Σ_j (P_j + N_j)(q_j − P_j/(P_j+N_j))²``
  (scikit-learn ``IsotonicRegression``), applied by linear interpolation between the fitted
  representatives, clipped at both ends (as scikit-learn's ``predict``).

A calibration is bound to the model it was fitted for (``model_sha256``, the SHA-256 of the signed
``Model`` bytes). Calibrated probabilities are an addition: the decision rule stays the paper's
``σ(z) > 0.5``.

Reliability (:func:`reliability_curve`): the probabilities are grouped into ``n_bins`` equal-width
bins of [0, 1] (the last one closed); per bin the mean predicted probability, the observed
frequency of positives and the weight. The expected calibration error is
``ECE = Σ_b (W_b / W) |ȳ_b − p̄_b|``. Weighted points let the same code run on rows (weight 1)
and on histogram bins (two points per bin with weights ``P_j`` and ``N_j``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from afl.core.evaluation.federated import EvaluationStats
from afl.core.evaluation.scorebins import ScoreBins

__all__ = [
    "FORMAT",
    "METHODS",
    "Calibration",
    "CalibrationError",
    "ClassCalibration",
    "Reliability",
    "calibration_document",
    "fit_calibration",
    "fit_class",
    "histogram_reliability",
    "reliability_curve",
]

Method = Literal["platt", "isotonic"]
METHODS: tuple[Method, ...] = ("platt", "isotonic")
FORMAT = "afl-calibration"


class CalibrationError(ValueError):
    """Calibration input or file is malformed, or does not belong to the model."""


@dataclass(frozen=True)
class ClassCalibration:
    """The fitted map of one class (``fitted`` False when its histogram had no positives or no
    negatives: its probabilities are then NaN, never a guess)."""

    name: str
    method: Method
    fitted: bool
    n_pos: int
    n_neg: int
    slope: float = math.nan  # platt: a
    intercept: float = math.nan  # platt: b
    x: tuple[float, ...] = ()  # isotonic: fitted representatives (increasing)
    y: tuple[float, ...] = ()  # isotonic: fitted probabilities

    def probabilities(self, scores: NDArray[np.floating]) -> NDArray[np.float64]:
        z = np.asarray(scores, dtype=np.float64)
        if not self.fitted:
            return np.full(z.shape, np.nan)
        if self.method == "platt":
            from scipy.special import expit  # on demand: importing afl.core loads no scipy

            out: NDArray[np.float64] = expit(self.slope * z + self.intercept)
            return out
        interpolated: NDArray[np.float64] = np.interp(z, np.asarray(self.x), np.asarray(self.y))
        return interpolated

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "name": self.name,
            "fitted": self.fitted,
            "n_pos": self.n_pos,
            "n_neg": self.n_neg,
        }
        if self.fitted and self.method == "platt":
            body.update(slope=self.slope, intercept=self.intercept)
        elif self.fitted:
            body.update(x=list(self.x), y=list(self.y))
        return body


@dataclass(frozen=True)
class Calibration:
    """Per-class calibration of one model's scores (module docstring)."""

    method: Method
    model_sha256: str
    bins: ScoreBins
    classes: tuple[ClassCalibration, ...]

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    def probabilities(
        self, scores: NDArray[np.floating], *, columns: Sequence[int] | None = None
    ) -> NDArray[np.float64]:
        """Calibrated probabilities of an (n, k) score matrix whose columns are the classes
        ``columns`` (default: every class, in order)."""
        cols = list(range(len(self.classes))) if columns is None else list(columns)
        z = np.asarray(scores, dtype=np.float64)
        if z.ndim != 2 or z.shape[1] != len(cols):
            raise CalibrationError(f"scores {z.shape} do not have {len(cols)} columns")
        out = np.empty(z.shape, dtype=np.float64)
        for j, c in enumerate(cols):
            out[:, j] = self.classes[c].probabilities(z[:, j])
        return out

    def check_model(self, model_sha256: str, classes: Sequence[str]) -> None:
        """Refuse a calibration fitted for another model or other classes."""
        if self.model_sha256 != model_sha256:
            raise CalibrationError(
                f"the calibration was fitted for model {self.model_sha256[:16]}…, not "
                f"{model_sha256[:16]}…"
            )
        if list(self.class_names) != list(classes):
            raise CalibrationError(
                f"the calibration's classes {list(self.class_names)} differ from the model's"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": 1,
            "method": self.method,
            "model_sha256": self.model_sha256,
            "score_bin_edges": list(self.bins.edges),
            "classes": [c.to_json() for c in self.classes],
            "note": "calibrated probabilities are an addition; the decision rule stays σ(z) > 0.5",
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Calibration:
        try:
            if doc.get("format") != FORMAT or doc.get("version") != 1:
                raise CalibrationError("not an afl calibration file (format/version)")
            method = doc["method"]
            if method not in METHODS:
                raise CalibrationError(f"unknown calibration method {method!r}")
            classes = []
            for c in doc["classes"]:
                fitted = bool(c["fitted"])
                classes.append(
                    ClassCalibration(
                        name=str(c["name"]),
                        method=method,
                        fitted=fitted,
                        n_pos=int(c["n_pos"]),
                        n_neg=int(c["n_neg"]),
                        slope=float(c["slope"]) if fitted and method == "platt" else math.nan,
                        intercept=float(c["intercept"])
                        if fitted and method == "platt"
                        else math.nan,
                        x=tuple(float(v) for v in c.get("x", ())),
                        y=tuple(float(v) for v in c.get("y", ())),
                    )
                )
            return cls(
                method,
                str(doc["model_sha256"]),
                ScoreBins.from_edges(doc["score_bin_edges"]),
                tuple(classes),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, CalibrationError):
                raise
            raise CalibrationError(f"malformed calibration: {exc}") from exc

    def save(self, path: str | os.PathLike[str]) -> Path:
        out = Path(path)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2), encoding="utf-8")
        tmp.replace(out)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        file = Path(path)
        try:
            doc = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CalibrationError(f"cannot read calibration {file}: {exc}") from exc
        try:
            return cls.from_json(doc)
        except CalibrationError as exc:
            raise CalibrationError(f"{file}: {exc}") from exc


def _platt(
    reps: NDArray[np.float64], pos: NDArray[np.float64], neg: NDArray[np.float64]
) -> tuple[float, float]:
    weight = pos + neg
    total = weight.sum()
    mean = float((weight * reps).sum() / total)
    spread = math.sqrt(float((weight * (reps - mean) ** 2).sum() / total))
    if spread == 0.0:
        raise CalibrationError("every score falls into one bin: Platt scaling is undefined")
    u = (reps - mean) / spread
    from scipy.optimize import minimize
    from scipy.special import expit, log_expit

    def nll(theta: NDArray[np.float64]) -> float:
        t = theta[0] * u + theta[1]
        return float(-(pos * log_expit(t) + neg * log_expit(-t)).sum() / total)

    def grad(theta: NDArray[np.float64]) -> NDArray[np.float64]:
        resid = (weight * expit(theta[0] * u + theta[1]) - pos) / total
        return np.array([(resid * u).sum(), resid.sum()])

    def hess(theta: NDArray[np.float64]) -> NDArray[np.float64]:
        p = expit(theta[0] * u + theta[1])
        v = weight * p * (1.0 - p) / total
        return np.array([[(v * u * u).sum(), (v * u).sum()], [(v * u).sum(), v.sum()]])

    prior = float(pos.sum() / total)
    start = np.array([0.0, math.log(prior / (1.0 - prior))])
    result = minimize(
        nll, start, jac=grad, hess=hess, method="trust-exact", options={"gtol": 1e-12}
    )
    alpha, beta = (float(v) for v in result.x)
    if not (math.isfinite(alpha) and math.isfinite(beta)):
        raise CalibrationError("Platt scaling did not converge (separable scores?)")
    return alpha / spread, beta - alpha * mean / spread


def fit_class(
    name: str,
    *,
    negatives: NDArray[np.integer],
    positives: NDArray[np.integer],
    bins: ScoreBins,
    method: Method = "platt",
) -> ClassCalibration:
    """Fit one class from its histograms (module docstring)."""
    if method not in METHODS:
        raise CalibrationError(f"unknown calibration method {method!r}; use one of {METHODS}")
    neg = np.asarray(negatives, dtype=np.float64)
    pos = np.asarray(positives, dtype=np.float64)
    if neg.shape != (bins.num_bins,) or pos.shape != (bins.num_bins,):
        raise CalibrationError(f"histograms must have {bins.num_bins} bins")
    n_pos, n_neg = int(pos.sum()), int(neg.sum())
    if n_pos == 0 or n_neg == 0:
        return ClassCalibration(name, method, False, n_pos, n_neg)
    occupied = (pos + neg) > 0
    reps = bins.representatives()[occupied]
    pos, neg = pos[occupied], neg[occupied]
    if method == "platt":
        slope, intercept = _platt(reps, pos, neg)
        return ClassCalibration(name, method, True, n_pos, n_neg, slope, intercept)
    from sklearn.isotonic import IsotonicRegression  # on demand: only an isotonic fit needs it

    iso = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip")
    iso.fit(reps, pos / (pos + neg), sample_weight=pos + neg)
    x = tuple(float(v) for v in iso.X_thresholds_)
    y = tuple(float(v) for v in iso.y_thresholds_)
    return ClassCalibration(name, method, True, n_pos, n_neg, x=x, y=y)


def fit_calibration(
    stats: EvaluationStats, *, model_sha256: str, method: Method = "platt"
) -> Calibration:
    """Fit every class from (summed) evaluation statistics."""
    classes = tuple(
        fit_class(
            name,
            negatives=stats.histograms[c, 0],
            positives=stats.histograms[c, 1],
            bins=stats.bins,
            method=method,
        )
        for c, name in enumerate(stats.classes)
    )
    return Calibration(method, model_sha256, stats.bins, classes)


@dataclass(frozen=True)
class Reliability:
    """Reliability curve on ``len(edges) − 1`` probability bins and the ECE."""

    edges: tuple[float, ...]
    mean_predicted: tuple[float, ...]  # NaN for an empty bin
    observed: tuple[float, ...]  # NaN for an empty bin
    weight: tuple[float, ...]
    ece: float

    def to_json(self) -> dict[str, Any]:
        def clean(v: float) -> float | None:
            return None if math.isnan(v) else v

        return {
            "edges": list(self.edges),
            "mean_predicted": [clean(v) for v in self.mean_predicted],
            "observed": [clean(v) for v in self.observed],
            "weight": list(self.weight),
            "ece": clean(self.ece),
        }


def reliability_curve(
    probabilities: NDArray[np.floating],
    labels: NDArray[np.integer],
    *,
    weights: NDArray[np.floating] | None = None,
    n_bins: int = 10,
) -> Reliability:
    """Reliability curve and ECE of (weighted) predictions (module docstring)."""
    p = np.asarray(probabilities, dtype=np.float64).ravel()
    y = np.asarray(labels, dtype=np.float64).ravel()
    w = np.ones_like(p) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    if not (p.shape == y.shape == w.shape) or not np.isfinite(p).all():
        raise CalibrationError("probabilities, labels and weights must be finite and aligned")
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    which = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, n_bins - 1)
    weight = np.bincount(which, weights=w, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_p = np.bincount(which, weights=w * p, minlength=n_bins) / weight
        freq = np.bincount(which, weights=w * y, minlength=n_bins) / weight
    total = weight.sum()
    used = weight > 0
    ece = float((weight[used] / total * np.abs(freq[used] - mean_p[used])).sum()) if total else 0.0
    return Reliability(
        tuple(float(e) for e in edges),
        tuple(float(v) for v in mean_p),
        tuple(float(v) for v in freq),
        tuple(float(v) for v in weight),
        ece,
    )


def histogram_reliability(
    bin_probabilities: NDArray[np.floating],
    *,
    negatives: NDArray[np.integer],
    positives: NDArray[np.integer],
    n_bins: int = 10,
) -> Reliability:
    """Reliability of the probabilities given to each score bin, weighted by its counts (what
    the coordinator can report from summed histograms alone)."""
    p = np.asarray(bin_probabilities, dtype=np.float64)
    neg = np.asarray(negatives, dtype=np.float64)
    pos = np.asarray(positives, dtype=np.float64)
    keep = (neg + pos) > 0
    p, neg, pos = p[keep], neg[keep], pos[keep]
    return reliability_curve(
        np.concatenate([p, p]),
        np.concatenate([np.ones_like(pos), np.zeros_like(neg)]),
        weights=np.concatenate([pos, neg]),
        n_bins=n_bins,
    )


def calibration_document(
    calibration: Calibration, stats: EvaluationStats, *, n_bins: int = 10
) -> dict[str, Any]:
    """The calibration file's content: the fit (:meth:`Calibration.to_json`) and, per class,
    the reliability and ECE of σ(z) and of the calibrated probabilities on the (summed)
    histograms it was fitted from: in-sample, but computable from the sums alone."""
    from scipy.special import expit

    reps = stats.bins.representatives()
    per_class: dict[str, Any] = {}
    for c, fitted in enumerate(calibration.classes):
        neg, pos = stats.histograms[c]
        entry = {
            "raw sigmoid": histogram_reliability(
                expit(reps), negatives=neg, positives=pos, n_bins=n_bins
            )
        }
        if fitted.fitted:
            entry[calibration.method] = histogram_reliability(
                fitted.probabilities(reps), negatives=neg, positives=pos, n_bins=n_bins
            )
        per_class[fitted.name] = {k: v.to_json() for k, v in entry.items()}
    return {
        **calibration.to_json(),
        "reliability": {
            "data": "the histograms the calibration was fitted from (in-sample)",
            "per_class": per_class,
        },
    }
