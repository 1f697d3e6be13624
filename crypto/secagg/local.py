"""In-process driver of one secure-aggregation round (docs/protocol.md §4.2): runs the client and
server state machines of :mod:`afl.crypto.secagg.client` / :mod:`afl.crypto.secagg.server` message
by message, with a drop-out schedule, and accounts CPU time per party and bytes per site.

A drop-out is given as the client stage *before* which the site vanishes: ``SHARE_KEYS`` means it
advertised keys and then sent nothing more; ``MASKED_INPUT`` means it vanished after ShareKeys;
``CONSISTENCY`` after MaskedInput; ``UNMASK`` during Unmask (after signing U3). Bytes are the
lengths of the messages' canonical encodings (``to_bytes``); a broadcast counts once per recipient.
With a sparse graph every site draws its graph nonce and the driver hands every party the
commitments (what the daemons carry in the signed plan decisions).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from numpy.typing import ArrayLike

from afl.crypto.secagg.client import SecAggClient
from afl.crypto.secagg.config import RoundConfig
from afl.crypto.secagg.graph import graph_commitment, new_graph_nonce
from afl.crypto.secagg.messages import ClientMessage, Stage
from afl.crypto.secagg.server import SecAggResult, SecAggServer

__all__ = ["LocalRoundReport", "run_local_round"]

_T = TypeVar("_T")


@dataclass
class LocalRoundReport:
    """Result and costs of an in-process round (seconds are wall-clock of each party's calls)."""

    result: SecAggResult
    server: SecAggServer
    client_seconds: dict[str, float] = field(default_factory=dict)
    server_seconds: float = 0.0
    bytes_up: dict[str, int] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=dict)


def run_local_round(
    *,
    config: RoundConfig,
    identity_keys: Mapping[str, Ed25519PrivateKey],
    inputs: Mapping[str, Mapping[str, ArrayLike]],
    drop_before: Mapping[str, Stage] | None = None,
    count_bytes: bool = True,
) -> LocalRoundReport:
    """Run one round over ``config.cohort`` and return the server's result with costs.

    ``inputs[site][release]`` is the site's vector for each release it is a member of.

    Raises:
        RoundAbortedError: too few clients at some stage (the server's ``abort_reason`` says why).
    """
    drops = dict(drop_before or {})
    identities = {s: k.public_key() for s, k in identity_keys.items()}
    sparse = config.graph is not None
    nonces = {s: new_graph_nonce() for s in config.cohort} if sparse else {}
    commitments = {
        s: graph_commitment(round_id=config.round_id, site_id=s, nonce=nonce)
        for s, nonce in nonces.items()
    }
    server = SecAggServer(
        config=config, identities=identities, commitments=commitments if sparse else None
    )
    clients: dict[str, SecAggClient] = {}
    report_times = {s: 0.0 for s in config.cohort}
    up = {s: 0 for s in config.cohort}
    down = {s: 0 for s in config.cohort}
    server_time = [0.0]

    def timed(site: str | None, call: Callable[[], _T]) -> _T:
        start = time.perf_counter()
        out = call()
        elapsed = time.perf_counter() - start
        if site is None:
            server_time[0] += elapsed
        else:
            report_times[site] += elapsed
        return out

    def alive(site: str, stage: Stage) -> bool:
        order = list(Stage)
        return site not in drops or order.index(stage) < order.index(drops[site])

    def size(message: object) -> int:
        to_bytes = getattr(message, "to_bytes", None)
        return len(to_bytes()) if count_bytes and to_bytes is not None else 0

    for site in config.cohort:
        clients[site] = timed(
            site,
            partial(
                SecAggClient,
                site_id=site,
                identity_key=identity_keys[site],
                config=config,
                identities=identities,
                inputs=inputs[site],
                graph_nonce=nonces.get(site),
            ),
        )

    def upload(site: str, message: ClientMessage) -> None:
        up[site] += size(message)
        timed(None, partial(server.receive, message, sender=site))

    for site in config.cohort:
        if alive(site, Stage.ADVERTISE):
            advertise = partial(clients[site].advertise_keys, commitments if sparse else None)
            upload(site, timed(site, advertise))
    directory = timed(None, server.close_advertise)
    for advert in directory.adverts:
        site = advert.site_id
        down[site] += size(directory)
        if alive(site, Stage.SHARE_KEYS):
            upload(site, timed(site, partial(clients[site].share_keys, directory)))
    routed = timed(None, server.close_share_keys)
    for site, bundle in routed.items():
        down[site] += size(bundle)
        if alive(site, Stage.MASKED_INPUT):
            upload(site, timed(site, partial(clients[site].masked_input, bundle)))
    request = timed(None, server.close_masked_input)
    for site in request.survivors:
        down[site] += size(request)
        if alive(site, Stage.CONSISTENCY):
            upload(site, timed(site, partial(clients[site].consistency_check, request)))
    unmask = timed(None, server.close_consistency)
    for signature in unmask.signatures:
        site = signature.site_id
        down[site] += size(unmask)
        if alive(site, Stage.UNMASK):
            upload(site, timed(site, partial(clients[site].unmask, unmask)))
    result = timed(None, server.close_unmask)
    return LocalRoundReport(
        result=result,
        server=server,
        client_seconds=report_times,
        server_seconds=server_time[0],
        bytes_up=up,
        bytes_down=down,
    )
