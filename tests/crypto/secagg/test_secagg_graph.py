"""The sparse masking graph (afl.crypto.secagg.graph, docs/protocol.md §4.2 "Sparse graph"):
H(n, k) on a seeded random ring is k-regular, symmetric and k-connected; the ring order is a
permutation fixed by the seed and uniform over seeds; the commitment and the seed bind every
input; and the two facts the failure bound rests on hold (an induced subgraph is disconnected iff
two runs of k/2 ring positions are missing; a site's colluding neighbours are hypergeometric)."""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter, deque
from collections.abc import Collection, Mapping

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from afl.crypto.errors import ProtocolError
from afl.crypto.secagg.graph import (
    commitments_digest,
    derive_graph,
    derive_neighbourhood,
    graph_commitment,
    graph_seed,
    harary_neighbours,
    ring_order,
)


def _seed(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def _connected(nodes: Collection[str], graph: Mapping[str, frozenset[str]]) -> bool:
    """Breadth-first search over the subgraph induced on ``nodes`` (the oracle)."""
    remaining = set(nodes)
    if not remaining:
        return True
    start = next(iter(remaining))
    seen, queue = {start}, deque([start])
    while queue:
        for v in graph[queue.popleft()] & remaining:
            if v not in seen:
                seen.add(v)
                queue.append(v)
    return seen == remaining


@st.composite
def _graphs(draw: st.DrawFn) -> tuple[list[str], int, bytes]:
    n = draw(st.integers(4, 40))
    k = 2 * draw(st.integers(1, (n - 2) // 2))
    return [f"s{i:02d}" for i in range(n)], k, draw(st.binary(min_size=32, max_size=32))


@settings(max_examples=60, deadline=None)
@given(spec=_graphs(), data=st.data())
def test_property_harary_graph_is_k_regular_symmetric_and_k_connected(
    spec: tuple[list[str], int, bytes], data: st.DataObject
) -> None:
    cohort, k, seed = spec
    graph = derive_graph(cohort, degree=k, seed=seed)
    assert set(graph) == set(cohort)
    for site, neighbours in graph.items():
        assert len(neighbours) == k and site not in neighbours
        assert all(site in graph[v] for v in neighbours)
    # k-connected: removing any k - 1 sites leaves the rest connected (a random such set).
    removed = data.draw(st.sets(st.sampled_from(cohort), max_size=k - 1))
    assert _connected(set(cohort) - removed, graph)


@settings(max_examples=60, deadline=None)
@given(spec=_graphs(), data=st.data())
def test_property_one_sites_neighbourhood_is_its_entry_in_the_whole_graph(
    spec: tuple[list[str], int, bytes], data: st.DataObject
) -> None:
    cohort, k, seed = spec
    site = data.draw(st.sampled_from(cohort))
    graph = derive_graph(cohort, degree=k, seed=seed)
    assert derive_neighbourhood(cohort, degree=k, seed=seed, site=site) == graph[site]


def test_the_neighbourhood_of_a_site_outside_the_cohort_or_with_a_bad_degree_is_refused() -> None:
    cohort = [f"s{i}" for i in range(8)]
    with pytest.raises(ProtocolError, match="not in the cohort"):
        derive_neighbourhood(cohort, degree=2, seed=bytes(32), site="s9")
    with pytest.raises(ProtocolError, match="even degree"):
        derive_neighbourhood(cohort, degree=3, seed=bytes(32), site="s1")


def test_a_degree_outside_2_to_n_minus_2_or_odd_is_refused() -> None:
    order = [f"s{i}" for i in range(8)]
    for k in (0, 3, 7, 8):
        with pytest.raises(ProtocolError, match="even degree"):
            harary_neighbours(order, k)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 60), seed=st.binary(min_size=32, max_size=32), flip=st.integers(0, 255))
def test_ring_order_is_a_permutation_fixed_by_the_seed(n: int, seed: bytes, flip: int) -> None:
    cohort = [f"s{i:02d}" for i in range(n)]
    order = ring_order(list(reversed(cohort)), seed)  # the input order does not matter
    assert sorted(order) == cohort and order == ring_order(cohort, seed)
    other = bytearray(seed)
    other[flip // 8] ^= 1 << (flip % 8)
    if n >= 20:  # 20! orders: two seeds giving the same one would be a 2^-61 accident
        assert ring_order(cohort, bytes(other)) != order


def test_ring_order_is_uniform_over_seeds() -> None:
    """χ² over the 24 orders of 4 sites from 4,800 seeds (expected 200 each)."""
    cohort = ["a", "b", "c", "d"]
    counts = Counter(ring_order(cohort, _seed(i)) for i in range(4800))
    assert len(counts) == 24
    chi2 = sum((c - 200) ** 2 / 200 for c in counts.values())
    assert stats.chi2.sf(chi2, df=23) > 1e-4


def test_commitments_and_the_seed_bind_every_input() -> None:
    nonce = bytes(32)
    base = graph_commitment(round_id="r1", site_id="s1", nonce=nonce)
    assert base != graph_commitment(round_id="r2", site_id="s1", nonce=nonce)
    assert base != graph_commitment(round_id="r1", site_id="s2", nonce=nonce)
    assert base != graph_commitment(round_id="r1", site_id="s1", nonce=bytes(31) + b"\x01")
    with pytest.raises(ProtocolError, match="32 bytes"):
        graph_commitment(round_id="r1", site_id="s1", nonce=b"short")
    listed = {"s1": base, "s2": b"x" * 32}
    assert commitments_digest(listed) != commitments_digest({**listed, "s2": b"y" * 32})
    assert commitments_digest(listed) != commitments_digest({"s1": base})
    nonces = {"s1": nonce, "s2": b"\x07" * 32}
    seed = graph_seed(config_digest=b"c" * 32, digest=b"d" * 32, nonces=nonces)
    assert seed != graph_seed(config_digest=b"C" * 32, digest=b"d" * 32, nonces=nonces)
    assert seed != graph_seed(config_digest=b"c" * 32, digest=b"D" * 32, nonces=nonces)
    assert seed != graph_seed(
        config_digest=b"c" * 32, digest=b"d" * 32, nonces={**nonces, "s2": b"\x08" * 32}
    )


def _missing_runs(present: set[int], n: int, reach: int) -> int:
    """How many maximal runs of >= reach consecutive ring positions are absent."""
    if not present:
        return 0
    start = min(present)
    runs, gap = 0, 0
    for step in range(1, n + 1):
        p = (start + step) % n
        if p in present:
            runs += gap >= reach
            gap = 0
        else:
            gap += 1
    return runs


@settings(max_examples=150, deadline=None)
@given(spec=_graphs(), keep=st.data())
def test_property_an_induced_subgraph_splits_iff_two_runs_of_k_over_2_are_missing(
    spec: tuple[list[str], int, bytes], keep: st.DataObject
) -> None:
    """The combinatorial fact behind E2 (afl.crypto.secagg.graph_bounds): on the ring of
    H(n, k) the sites in ``present`` are connected iff at most one run of k/2 or more
    consecutive positions is missing."""
    cohort, k, seed = spec
    order = ring_order(cohort, seed)
    graph = harary_neighbours(order, k)
    present = keep.draw(st.sets(st.integers(0, len(order) - 1), min_size=1))
    sites = {order[p] for p in present}
    assert _connected(sites, graph) == (_missing_runs(present, len(order), k // 2) <= 1)


def test_colluding_neighbours_of_an_honest_site_are_hypergeometric() -> None:
    """The model behind E1: for a fixed colluder set and the graph drawn from a fresh seed, the
    number of colluders among an honest site's k neighbours follows Hyp(n - 1, C, k)."""
    n, k, colluders = 14, 6, 4
    cohort = [f"s{i:02d}" for i in range(n)]
    corrupt = set(cohort[1 : 1 + colluders])
    counts = Counter(
        len(derive_graph(cohort, degree=k, seed=_seed(i))["s00"] & corrupt) for i in range(3000)
    )
    pmf = stats.hypergeom(n - 1, colluders, k).pmf
    expected = np.array([3000 * pmf(c) for c in range(colluders + 1)])
    observed = np.array([counts.get(c, 0) for c in range(colluders + 1)])
    chi2 = float(np.sum((observed - expected) ** 2 / expected))
    assert stats.chi2.sf(chi2, df=colluders) > 1e-4


def test_every_pair_of_sites_is_neighbours_in_some_graph() -> None:
    """No pair is excluded by construction: the ring order really moves every site."""
    cohort = [f"s{i}" for i in range(8)]
    seen: set[frozenset[str]] = set()
    for i in range(200):
        graph = derive_graph(cohort, degree=2, seed=_seed(i))
        seen |= {frozenset((u, v)) for u in cohort for v in graph[u]}
    assert seen == {frozenset(p) for p in itertools.combinations(cohort, 2)}
