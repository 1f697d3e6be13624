"""The sparse masking graph of a round (SecAgg+, Bell et al. CCS 2020; docs/protocol.md §4.2
"Sparse graph"): a random Harary graph H(n, k) over the cohort, derived by every party from
randomness no single party chooses.

Randomness (commit, then reveal):

1. Plan review: each site draws a fresh 32-byte nonce ρ_u (OS CSPRNG) and signs, with its
   acceptance of the plan, the commitment c_u = SHA-256(canonical(DOMAIN_TAG, "graph-commitment",
   round_id, u, ρ_u)) (:func:`graph_commitment`).
2. AdvertiseKeys: each site fetches every participant's signed commitment, checks each signature
   with its own kit's keys, and signs its advert over Δ = :func:`commitments_digest` of that
   list and over ρ_u (the reveal). An honest site reveals only after the list is fixed, and
   every advert binds the list it was made for, so the coordinator cannot show two sites two
   lists (the sites compare Δ in each other's adverts) and no colluder can change its nonce after
   seeing the honest ones (its nonce must open its commitment).
3. ShareKeys: with every participant's advert (a missing nonce aborts the round: the graph is
   never drawn from a subset of the nonces), the seed is

       seed = SHA-256(canonical(DOMAIN_TAG, "mask-graph", config digest, Δ, n, (u, ρ_u) sorted by u))

   A colluding party can only abort (and so see the graph of another round with fresh nonces),
   never pick one: each round's graph is uniform given the colluders, and R attempted rounds
   raise the failure probability of :mod:`afl.crypto.secagg.graph_bounds` at most R-fold.

Graph: the cohort in a uniformly random ring order π (a Fisher–Yates shuffle driven by
AES-256-CTR keyed with the seed, :func:`afl.crypto.prg.expand_seed`, unbiased by rejection
sampling), and each site joined to the k/2 nearest ring positions on either side:

    N(u) = { π⁻¹((π(u) + j) mod n) : j = ±1, …, ±k/2 }    (k even, 2 <= k <= n - 2)

so every site has exactly k neighbours, the relation is symmetric, and the graph is k-connected.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence

from afl.crypto.canonical import DOMAIN_TAG, Field, canonical_encode
from afl.crypto.errors import ProtocolError
from afl.crypto.prg import expand_seed

__all__ = [
    "GRAPH_NONCE_BYTES",
    "commitments_digest",
    "derive_graph",
    "derive_neighbourhood",
    "graph_commitment",
    "graph_seed",
    "harary_neighbours",
    "new_graph_nonce",
    "ring_order",
]

GRAPH_NONCE_BYTES = 32
_BLOCK_WORDS = 256


def new_graph_nonce() -> bytes:
    """A fresh graph nonce ρ_u from the OS CSPRNG."""
    return os.urandom(GRAPH_NONCE_BYTES)


def _check_nonce(nonce: object) -> bytes:
    if not isinstance(nonce, bytes) or len(nonce) != GRAPH_NONCE_BYTES:
        raise ProtocolError(f"a graph nonce is exactly {GRAPH_NONCE_BYTES} bytes")
    return nonce


def graph_commitment(*, round_id: str, site_id: str, nonce: bytes) -> bytes:
    """c_u = SHA-256(canonical(DOMAIN_TAG, "graph-commitment", round_id, u, ρ_u))."""
    fields: tuple[Field, ...] = (
        DOMAIN_TAG,
        "graph-commitment",
        round_id,
        site_id,
        _check_nonce(nonce),
    )
    return hashlib.sha256(canonical_encode(fields)).digest()


def commitments_digest(commitments: Mapping[str, bytes]) -> bytes:
    """Δ = SHA-256 of every participant's commitment, sorted by site id."""
    fields: list[Field] = [DOMAIN_TAG, "graph-commitments", len(commitments)]
    for site in sorted(commitments):
        fields += [site, commitments[site]]
    return hashlib.sha256(canonical_encode(fields)).digest()


def graph_seed(*, config_digest: bytes, digest: bytes, nonces: Mapping[str, bytes]) -> bytes:
    """The seed of the round's graph from the config digest, Δ and every revealed nonce."""
    fields: list[Field] = [DOMAIN_TAG, "mask-graph", config_digest, digest, len(nonces)]
    for site in sorted(nonces):
        fields += [site, _check_nonce(nonces[site])]
    return hashlib.sha256(canonical_encode(fields)).digest()


def _words(seed: bytes) -> Iterator[int]:
    block = 0
    while True:
        stream = expand_seed(seed, n_words=_BLOCK_WORDS, context=("ring-order", block))
        yield from (int(w) for w in stream)
        block += 1


def _below(words: Iterator[int], bound: int) -> int:
    """A uniform integer in [0, bound) by rejection from uniform 64-bit words."""
    limit = (1 << 64) - (1 << 64) % bound
    while True:
        w = next(words)
        if w < limit:
            return w % bound


def ring_order(cohort: Sequence[str], seed: bytes) -> tuple[str, ...]:
    """π: the sorted cohort shuffled by Fisher–Yates with the seed's PRG (deterministic)."""
    order = sorted(cohort)
    words = _words(seed)
    for i in range(len(order) - 1, 0, -1):
        j = _below(words, i + 1)
        order[i], order[j] = order[j], order[i]
    return tuple(order)


def _check_degree(n: int, degree: int) -> int:
    if degree % 2 or not 2 <= degree <= n - 2:
        raise ProtocolError(f"a sparse graph needs an even degree k in 2..{n - 2}, got {degree}")
    return degree // 2


def _around(order: Sequence[str], position: int, reach: int) -> frozenset[str]:
    """The sites within ``reach`` ring positions of ``position`` on either side."""
    n = len(order)
    return frozenset(order[(position + j) % n] for j in range(-reach, reach + 1) if j)


def harary_neighbours(order: Sequence[str], degree: int) -> dict[str, frozenset[str]]:
    """N(u) of H(n, k) on the ring ``order`` for every u (module docstring)."""
    reach = _check_degree(len(order), degree)
    return {site: _around(order, p, reach) for p, site in enumerate(order)}


def derive_graph(cohort: Sequence[str], *, degree: int, seed: bytes) -> dict[str, frozenset[str]]:
    """The round's neighbourhoods: H(n, k) on :func:`ring_order` of the cohort."""
    return harary_neighbours(ring_order(cohort, seed), degree)


def derive_neighbourhood(
    cohort: Sequence[str], *, degree: int, seed: bytes, site: str
) -> frozenset[str]:
    """N(``site``) alone: ``derive_graph(...)[site]`` in O(n + k) instead of O(n k) (a site
    needs only its own neighbours; every site still shuffles the whole ring)."""
    order = ring_order(cohort, seed)
    reach = _check_degree(len(order), degree)
    try:
        position = order.index(site)
    except ValueError:
        raise ProtocolError(f"site {site!r} is not in the cohort") from None
    return _around(order, position, reach)
