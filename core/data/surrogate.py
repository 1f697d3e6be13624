"""SURROGATE features on the real label matrix: the embedded default data set (docs/method.md §2).

No NIH images and no pretrained weights are available on these machines, so the default data
set pairs the REAL NIH label matrix with synthetic image features. Everything computed from
them is NOT a result on chest X-rays: outputs must always be labelled ``SURROGATE_LABEL``
("surrogate"), e.g. through ``CacheMeta(surrogate=True, source=SURROGATE_LABEL)``.

Generative model, row i with labels ``y_i`` in {0,1}^C at site ``s_i``, ``d`` dimensions::

    z_i = b + A^T u_i + sum_c y_ic * sigma * delta_c * D_c + m_{s_i} + sigma * e_i
    h_i = scale * softplus(z_i)

- ``b`` (d,): per-dimension bias ``bias + 0.5 N(0, 1)`` (features differ in mean activation);
- ``A^T u_i``: shared low-rank part, ``u_i ~ N(0, I_r)``, ``A`` (r, d) with variance
  ``shared_var / r`` per entry (anatomy/acquisition variability common to all classes);
- ``D_c``: a random unit direction per class; ``delta_c`` is the class's separation in units of
  the noise sd, ``delta_c = gain * sqrt(2) * Phi^{-1}(auc_c)``: ``auc_c`` is the AUC the
  ideal linear rule would reach on the latent for class c alone, before the nonlinearity,
  the other classes and estimation from finite data reduce it (rare classes lose most);
- ``m_k ~ N(0, site_shift^2 I)``: a per-site shift (non-IID sites; site -1 means no shift);
- ``e_i ~ N(0, I_d)`` noise with sd ``sigma = noise_sd``.

``h`` is non-negative with magnitudes O(0.1-1), like TorchXRayVision DenseNet ``features2``
(ReLU + global average pooling). The default profile is tuned so that the centrally trained
balanced ridge head (gamma = 1) on the 7:3 image-wise NIH PA split reaches a macro test AUC
of about 0.78 (target range 0.75-0.85; the paper reports ~0.77 on real features).

Determinism: global parameters come from ``default_rng([seed, 0])``, site shifts from
``default_rng([seed, 2, k])`` and the rows of chunk j (``CHUNK_ROWS`` rows) from
``default_rng([seed, 1, j])``; every chunk is generated at full size, so row i depends only on
(seed, i, y_i, s_i, config): results are bit-identical for any block size and any prefix.
Generation is in float64 per chunk; the output is float32 (the feature cache's precision).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
from numpy.typing import NDArray

SURROGATE_LABEL = "surrogate"
CHUNK_ROWS = 2048

NIH_LATENT_AUC: dict[str, float] = {
    "Atelectasis": 0.77,
    "Cardiomegaly": 0.88,
    "Consolidation": 0.75,
    "Edema": 0.85,
    "Effusion": 0.83,
    "Emphysema": 0.85,
    "Fibrosis": 0.76,
    "Hernia": 0.85,
    "Infiltration": 0.70,
    "Mass": 0.80,
    "Nodule": 0.74,
    "Pleural_Thickening": 0.75,
    "Pneumonia": 0.72,
    "Pneumothorax": 0.85,
}
"""Illustrative per-class difficulty profile (in the spirit of published DenseNet-121 results on
ChestX-ray14: cardiomegaly/effusion/pneumothorax easy, infiltration/nodule/pneumonia hard).
These are generator settings, not measurements."""
DEFAULT_LATENT_AUC = 0.80


class SurrogateError(ValueError):
    """Bad input to the surrogate generator."""


@dataclass(frozen=True)
class SurrogateConfig:
    """Knobs of the generative model (see the module docstring)."""

    rank: int = 32
    shared_var: float = 1.0
    noise_sd: float = 0.7
    site_shift: float = 0.5
    bias: float = -0.8
    scale: float = 0.5
    gain: float = 1.45

    def to_dict(self) -> dict[str, Any]:
        """For the cache's ``meta.extra`` / result provenance."""
        return asdict(self)


def class_separations(
    *,
    num_classes: int,
    classes: Sequence[str] | None = None,
    latent_auc: Sequence[float] | None = None,
    gain: float = SurrogateConfig.gain,
) -> NDArray[np.float64]:
    """``delta_c = gain * sqrt(2) * Phi^{-1}(auc_c)`` (AUC of two unit-variance Gaussians).

    ``auc_c`` comes from ``latent_auc`` if given, else from :data:`NIH_LATENT_AUC` by class
    name (``DEFAULT_LATENT_AUC`` for unknown names or when ``classes`` is None).
    """
    if latent_auc is not None:
        aucs = [float(a) for a in latent_auc]
    elif classes is not None:
        aucs = [NIH_LATENT_AUC.get(name, DEFAULT_LATENT_AUC) for name in classes]
    else:
        aucs = [DEFAULT_LATENT_AUC] * num_classes
    if len(aucs) != num_classes:
        raise SurrogateError(f"{len(aucs)} class difficulties for {num_classes} classes")
    if not all(0.5 <= a < 1.0 for a in aucs):
        raise SurrogateError(f"latent AUCs must be in [0.5, 1), got {aucs}")
    inv = NormalDist().inv_cdf
    return np.asarray([gain * np.sqrt(2.0) * inv(a) for a in aucs], dtype=np.float64)


def _check_inputs(
    labels: NDArray[Any], site: NDArray[Any], d: int
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    y = np.asarray(labels)
    s = np.asarray(site)
    if y.ndim != 2 or y.shape[1] < 1:
        raise SurrogateError(f"labels must be (N, C), got shape {y.shape}")
    if not np.isin(y, (0, 1)).all():
        raise SurrogateError("labels must be complete 0/1 (no -1 'absent' entries)")
    if s.shape != (y.shape[0],) or not np.issubdtype(s.dtype, np.integer):
        raise SurrogateError(
            f"site must be an integer array of shape ({y.shape[0]},), got {s.dtype}{s.shape}"
        )
    if s.size and s.min() < -1:
        raise SurrogateError("site ids must be >= 0 (or -1 for 'no site shift')")
    if d < 1:
        raise SurrogateError(f"d must be positive, got {d}")
    return y.astype(np.float64), s.astype(np.int64)


def iter_surrogate_blocks(
    *,
    labels: NDArray[Any],
    site: NDArray[Any],
    d: int = 1024,
    seed: int = 0,
    classes: Sequence[str] | None = None,
    latent_auc: Sequence[float] | None = None,
    config: SurrogateConfig | None = None,
    block_rows: int = 8 * CHUNK_ROWS,
) -> Iterator[tuple[int, NDArray[np.float32]]]:
    """Yield ``(start, features[start:start+rows])`` blocks in order (for streaming writes).

    ``block_rows`` is rounded up to a multiple of ``CHUNK_ROWS``; it affects memory only.
    """
    cfg = config or SurrogateConfig()
    y, s = _check_inputs(labels, site, d)
    n, c = y.shape
    if cfg.rank < 0 or cfg.noise_sd <= 0 or cfg.scale <= 0:
        raise SurrogateError(f"bad config {cfg}")
    delta = class_separations(num_classes=c, classes=classes, latent_auc=latent_auc, gain=cfg.gain)
    g = np.random.default_rng([seed, 0])
    a_mat = g.standard_normal((cfg.rank, d)) * np.sqrt(cfg.shared_var / max(cfg.rank, 1))
    bias = cfg.bias + 0.5 * g.standard_normal(d)
    dirs = g.standard_normal((c, d))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    class_part = (cfg.noise_sd * delta)[:, None] * dirs  # (C, d)
    num_sites = int(s.max()) + 1 if s.size else 0
    shifts = np.zeros((num_sites + 1, d))  # last row: site -1, no shift
    for k in range(num_sites):
        shifts[k] = cfg.site_shift * np.random.default_rng([seed, 2, k]).standard_normal(d)

    step = max(1, -(-block_rows // CHUNK_ROWS)) * CHUNK_ROWS
    for start in range(0, n, step):
        stop = min(start + step, n)
        out = np.empty((stop - start, d), dtype=np.float32)
        for c0 in range(start, stop, CHUNK_ROWS):
            rows = min(CHUNK_ROWS, stop - c0)
            rng = np.random.default_rng([seed, 1, c0 // CHUNK_ROWS])
            u = rng.standard_normal((CHUNK_ROWS, cfg.rank))
            z = rng.standard_normal((CHUNK_ROWS, d))
            z *= cfg.noise_sd
            y_chunk = np.zeros((CHUNK_ROWS, c))
            y_chunk[:rows] = y[c0 : c0 + rows]
            z += u @ a_mat
            z += y_chunk @ class_part
            z += bias
            z[:rows] += shifts[s[c0 : c0 + rows]]  # index -1 -> the zero row
            np.logaddexp(0.0, z, out=z)  # softplus
            z *= cfg.scale
            out[c0 - start : c0 - start + rows] = z[:rows]
        yield start, out


def surrogate_features(
    *,
    labels: NDArray[Any],
    site: NDArray[Any],
    d: int = 1024,
    seed: int = 0,
    classes: Sequence[str] | None = None,
    latent_auc: Sequence[float] | None = None,
    config: SurrogateConfig | None = None,
    block_rows: int = 8 * CHUNK_ROWS,
) -> NDArray[np.float32]:
    """All N rows of SURROGATE features, float32 (N, d), non-negative (see module docstring).

    ``labels``: int (N, C) complete 0/1 matrix (the real NIH labels); ``site``: int (N,) site of
    each row in [0, K) (-1: no site shift, e.g. for a held-out test set). ``classes`` names
    the columns to pick the per-class difficulty from :data:`NIH_LATENT_AUC`; ``latent_auc``
    overrides it. Label every output derived from these features as ``SURROGATE_LABEL``.
    """
    n = np.asarray(labels).shape[0]
    out = np.empty((n, d), dtype=np.float32)
    for start, block in iter_surrogate_blocks(
        labels=labels,
        site=site,
        d=d,
        seed=seed,
        classes=classes,
        latent_auc=latent_auc,
        config=config,
        block_rows=block_rows,
    ):
        out[start : start + block.shape[0]] = block
    return out
