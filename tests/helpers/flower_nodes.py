"""Flower nodes without Flower, for the relay tests: an in-process
:class:`afl.flower.relay.Transport` whose nodes are afl sites run as afl's ClientApp runs them
(:func:`afl.flower.site.handle`: the record encoding both ways, the session sealed between
messages), or any other handler (an impostor, a tampering transport).

A pushed message is handled when the relay next pulls; each handler sees the coordinator's
:class:`~afl.flower.envelope.ToSite` and answers a :class:`~afl.flower.envelope.FromSite`. A
fresh :class:`~afl.flower.site.FlowerSite` per message (``fresh_process=True``) is what the
deployment engine does (a new ClientApp process per message).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.client.config import load_client_config
from afl.core.aggregation import federated_solve
from afl.flower.envelope import FromSite, ToSite, from_site
from afl.flower.relay import RelayOutcome, Reply, serve_federation
from afl.flower.site import handle, open_site
from afl.lab.demo.federation import (
    LoopbackFederation,
    ckks_round_settings,
    mask_round_settings,
    prepare_labelled_everywhere,
)
from tests.e2e.ckks_tolerance import entry_bound, w_tolerance
from tests.e2e.loopback import SiteData, cached_statistics

Handler = Callable[[ToSite], FromSite]
CLASSES = ("A", "B", "C")


def small_federation(
    root: Path,
    data: SiteData,
    *,
    k: int = 3,
    mode: str = "mask",
    allow_plaintext: bool = False,
    **round_: Any,
) -> LoopbackFederation:
    """A loopback federation of ``k`` sites drawn from ``data`` (classes A, B, C, every site
    labels all) with one ``mode`` round; a CKKS federation has its decryptor site."""
    feats, labels = data.draw(k)
    settings: dict[str, Any] = {"gram_scope": "global", "upload_timeout_s": 60.0, **round_}
    if mode == "mask":
        settings.update(mask_round_settings(feats))
    elif mode == "ckks":
        settings.update(ckks_round_settings(feats))
    else:
        settings["aggregation"] = mode
    return prepare_labelled_everywhere(
        root,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        test_rows=20,
        round_settings=settings,
        allow_plaintext=allow_plaintext,
        decryptor=mode == "ckks",
    )


def ckks_reference(
    fed: LoopbackFederation, data: SiteData, *, k: int = 3
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The plaintext W of ``fed``'s caches (oracle: the in-process solve) and, per class, the
    derived bound on a CKKS W's distance to it (tests/e2e/ckks_tolerance.py), checked to be
    not vacuous."""
    stats, _ = cached_statistics(fed, list(fed.site_ids))
    w_plain, _ = federated_solve(stats, gamma=1.0, gram_scope="global")
    settings = ckks_round_settings(data.draw(k)[0])
    gram_bound, vector_bound = settings["ckks_gram_bound"], settings["ckks_vector_bound"]
    assert isinstance(gram_bound, float) and isinstance(vector_bound, float)
    tol = w_tolerance(
        gram=np.sum([s.gram for s in stats], axis=0),
        weights=w_plain,
        gamma=1.0,
        eps_gram=entry_bound(bound=gram_bound, members=k),
        eps_b=entry_bound(bound=vector_bound, members=k),
    )
    assert np.all(tol <= 1e-7 * np.linalg.norm(w_plain, axis=0))  # the bound is not vacuous
    return w_plain, tol


class SiteNode:
    """afl's site behind a Flower node (module docstring)."""

    def __init__(self, config: Path, *, fresh_process: bool = False) -> None:
        self.config, self.fresh = config, fresh_process
        self.site = open_site(load_client_config(config))
        self.sealed: bytes | None = None

    def __call__(self, message: ToSite) -> FromSite:
        if self.fresh:
            self.site = open_site(load_client_config(self.config))
        reply, self.sealed = handle(self.site, message.record(), self.sealed)
        return from_site(reply)


@dataclass
class InProcessTransport:
    """Nodes 1..n in process (module docstring); ``exchanges`` logs every message and reply."""

    handlers: Mapping[int, Handler]
    exchanges: list[tuple[int, ToSite, FromSite | None]] = field(default_factory=list)
    _queue: dict[str, tuple[int, ToSite]] = field(default_factory=dict)
    _ids: Any = field(default_factory=itertools.count)

    def node_ids(self) -> list[int]:
        return list(self.handlers)

    def push(self, messages: list[tuple[int, ToSite]]) -> list[str]:
        ids = []
        for node, message in messages:
            mid = f"m{next(self._ids)}"
            self._queue[mid] = (node, message)
            ids.append(mid)
        return ids

    def pull(self, message_ids: Collection[str]) -> list[Reply]:
        replies = []
        for mid in message_ids:
            if mid not in self._queue:
                continue
            node, message = self._queue.pop(mid)
            try:
                reply: FromSite | None = self.handlers[node](message)
            except Exception as exc:  # a failed ClientApp: Flower replies with its error
                self.exchanges.append((node, message, None))
                replies.append(Reply(mid, node, None, f"{type(exc).__name__}: {exc}"))
                continue
            self.exchanges.append((node, message, reply))
            replies.append(Reply(mid, node, reply))
        return replies


def site_nodes(
    fed: LoopbackFederation, sites: Sequence[str] | None = None, *, fresh_process: bool = False
) -> dict[int, Handler]:
    """A node per site of ``fed`` (all by default), numbered from 1 in site order, then its CKKS
    decryptor if it has one."""
    chosen = list(fed.site_ids if sites is None else sites)
    kits = [fed.client_configs[s] for s in chosen]
    kits += [fed.decryptor_config] if fed.decryptor_config is not None else []
    return {k + 1: SiteNode(kit, fresh_process=fresh_process) for k, kit in enumerate(kits)}


def serve(
    fed: LoopbackFederation, handlers: Mapping[int, Handler], *, max_wait_s: float = 300.0
) -> tuple[RelayOutcome, InProcessTransport]:
    """Serve ``fed``'s active run to ``handlers`` through the relay, in process."""
    transport = InProcessTransport(handlers)
    return serve_federation(fed.server_config, transport, max_wait_s=max_wait_s), transport
