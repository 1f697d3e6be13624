"""The CKKS-vs-plaintext tolerance on W derived in docs/protocol.md ("CKKS precision").

Per released entry, |CKKS value - plaintext-mode value| <= eps = error_bound(s, K, g) (decryptor,
afl.crypto.ckks.params) + K²·u·B (float64 summation of the plaintext mode), u = 2^-53. With
A = G + γI (SPD, eigenvalues λ_min..λ_max), E = the symmetric Gram error (‖E‖₂ <= d·eps_G) and
e_c the class-vector error (‖e_c‖₂ <= √d·eps_b), Ã⁻¹ exists when d·eps_G < λ_min and

    ‖w̃_c - w_c‖₂ <= (√d·eps_b + d·eps_G·‖w_c‖₂) / (λ_min - d·eps_G) + 2·κ(A)·(3d+1)·d·u·‖w_c‖₂,

the last term bounding the float64 round-off of the two Cholesky solves (Higham, Thm 10.4).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from afl.crypto.ckks import params as cp

U = 2.0**-53


def entry_bound(*, bound: float, members: int) -> float:
    """eps: bound on one released entry's CKKS-vs-plaintext difference for K = ``members``."""
    prescale = cp.choose_prescale(bound=bound, num_summands=members)
    grid = cp.default_grid(prescale=prescale, num_summands=members)
    ckks_err = cp.error_bound(prescale=prescale, num_summands=members, grid=grid)
    return ckks_err + members * members * U * bound


def w_tolerance(
    *,
    gram: NDArray[np.float64],
    weights: NDArray[np.float64],
    gamma: float,
    eps_gram: float,
    eps_b: float,
) -> NDArray[np.float64]:
    """Per-column bound on ‖w̃_c - w_c‖₂ (module docstring); ``weights`` is the plaintext W."""
    d = gram.shape[0]
    eig = np.linalg.eigvalsh(gram + gamma * np.eye(d))
    lam_min, lam_max = float(eig[0]), float(eig[-1])
    if d * eps_gram >= lam_min:
        raise ValueError("the CKKS error could make the regularised Gram singular: no bound")
    norms = np.linalg.norm(weights, axis=0)
    kappa = lam_max / lam_min
    perturb = (math.sqrt(d) * eps_b + d * eps_gram * norms) / (lam_min - d * eps_gram)
    return np.asarray(perturb + 2 * kappa * (3 * d + 1) * d * U * norms, dtype=np.float64)
