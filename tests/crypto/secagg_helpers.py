"""Shared helpers of the secure-aggregation protocol tests: cohorts, release plans, inputs, honest
clients and server for a cohort, and an exact plaintext oracle (math.fsum over the surviving
members)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from numpy.typing import NDArray

from afl.crypto.fixedpoint import FixedPointCodec
from afl.crypto.identity.signatures import generate_identity_key
from afl.crypto.secagg.client import SecAggClient
from afl.crypto.secagg.config import ReleaseSpec, RoundConfig, SparseGraph
from afl.crypto.secagg.messages import ConsistencyRequest
from afl.crypto.secagg.server import SecAggServer

GRAM_BOUND = 1e4
B_BOUND = 1.0


@dataclass
class Federation:
    """Config, identity keys and per-site inputs of one test round."""

    config: RoundConfig
    keys: dict[str, Ed25519PrivateKey]
    inputs: dict[str, dict[str, NDArray[np.float64]]]


def site_ids(n: int) -> list[str]:
    return [f"site-{i:02d}" for i in range(n)]


def make_federation(
    *,
    n: int,
    releases: Sequence[tuple[str, Sequence[str], int, float]] | None = None,
    threshold: int | None = None,
    seed: int = 0,
    round_id: str = "round-0001",
    graph: SparseGraph | None = None,
) -> Federation:
    """A cohort of n sites; default plan: "gram" (d=20, bound 1e4) and "b" (d=7, bound 1) over all.

    ``releases`` entries are (name, members, length, bound); inputs are uniform test data within
    ±bound/2 (numpy RNG is fine for test data, never for masks).
    """
    ids = site_ids(n)
    plan = releases or [("gram", ids, 20, GRAM_BOUND), ("b", ids, 7, B_BOUND)]
    specs = [
        ReleaseSpec(name, tuple(members), length, bound) for name, members, length, bound in plan
    ]
    config = RoundConfig.create(
        round_id=round_id, cohort=ids, releases=specs, threshold=threshold, graph=graph
    )
    rng = np.random.default_rng(seed)
    inputs: dict[str, dict[str, NDArray[np.float64]]] = {s: {} for s in ids}
    for spec in specs:
        for s in spec.members:
            inputs[s][spec.name] = rng.uniform(-spec.bound / 2, spec.bound / 2, spec.length)
    return Federation(config, {s: generate_identity_key() for s in ids}, inputs)


def honest_clients(fed: Federation) -> dict[str, SecAggClient]:
    """One honest client per cohort member (cohort order), knowing every member's identity key."""
    identities = {s: k.public_key() for s, k in fed.keys.items()}
    return {
        s: SecAggClient(
            site_id=s,
            identity_key=fed.keys[s],
            config=fed.config,
            identities=identities,
            inputs=fed.inputs[s],
        )
        for s in fed.config.cohort
    }


def honest_round(fed: Federation) -> tuple[SecAggServer, dict[str, SecAggClient]]:
    """A server for ``fed``'s round and its honest clients, before any message was sent."""
    server = SecAggServer(
        config=fed.config, identities={s: k.public_key() for s, k in fed.keys.items()}
    )
    return server, honest_clients(fed)


def run_to_survivors(
    server: SecAggServer, clients: Mapping[str, SecAggClient], *, silent: Iterable[str] = ()
) -> ConsistencyRequest:
    """Run the round honestly through AdvertiseKeys, ShareKeys and MaskedInput: the survivor
    list U3 the server then sends; ``silent`` sites vanish after ShareKeys (U2 \\ U3)."""
    for s, c in clients.items():
        server.receive(c.advertise_keys(), sender=s)
    directory = server.close_advertise()
    for s, c in clients.items():
        server.receive(c.share_keys(directory), sender=s)
    routed = server.close_share_keys()
    gone = set(silent)
    for s, c in clients.items():
        if s not in gone:
            server.receive(c.masked_input(routed[s]), sender=s)
    return server.close_masked_input()


def exact_sum(
    inputs: Mapping[str, Mapping[str, NDArray[np.float64]]], release: str, sites: Iterable[str]
) -> NDArray[np.float64]:
    """Correctly rounded Σ_{s∈sites} x_{s,release} (math.fsum per entry): the oracle."""
    vectors = [inputs[s][release] for s in sites]
    return np.array([math.fsum(col) for col in zip(*vectors, strict=True)], dtype=np.float64)


def assert_sum_matches(
    decoded: NDArray[np.float64], exact: NDArray[np.float64], codec: FixedPointCodec
) -> None:
    """Decoded sum equals the float64 sum to ≤1e-9 relative (in max norm) and entrywise to the
    codec's rounding bound K·2^-(f+1)."""
    scale = float(np.max(np.abs(exact)))
    assert float(np.max(np.abs(decoded - exact))) <= 1e-9 * scale
    np.testing.assert_allclose(decoded, exact, rtol=1e-12, atol=codec.sum_error_bound)
