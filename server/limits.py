"""Per-site limits on long-lived streams, so one enrolled site cannot starve the others
(docs/protocol.md §3, docs/operations.md).

The gRPC server runs every call on a worker thread, and a stream holds its thread for its
lifetime: a ``WatchRounds`` or ``Download`` stream until it ends, an ``Upload`` until its last
chunk arrives. Without limits, one site holding enough streams (or uploads that stall after one
chunk) occupies every worker. So:

* :class:`SiteStreams` counts each site's open streams per kind (``watch``, ``upload``,
  ``download``); a stream beyond the site's limit is refused at once with
  :class:`LimitExceededError` (gRPC RESOURCE_EXHAUSTED, the message names the limit and its
  ``[limits]`` key);
* :func:`idle_limited` ends an upload whose next chunk does not arrive within
  ``upload_idle_timeout_s`` with :class:`IdleStreamError` (gRPC DEADLINE_EXCEEDED), freeing the
  worker and the site's slot;
* :func:`worker_threads` sizes the server's pool so that every provisioned site can hold all of
  its streams at once and unary calls still find a worker.

Settings: ``[limits]`` of server.toml (:class:`StreamLimits`, defaults below).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from afl.server.errors import ServerError

__all__ = [
    "IdleStreamError",
    "LimitExceededError",
    "SiteStreams",
    "StreamLimits",
    "held_calls",
    "idle_limited",
    "worker_threads",
]

T = TypeVar("T")

#: Workers kept for unary calls beyond every site's streams.
UNARY_WORKERS = 16


class LimitExceededError(ServerError):
    """A site asked for more concurrent streams than ``[limits]`` allows (RESOURCE_EXHAUSTED)."""


class IdleStreamError(ServerError):
    """An upload stream sent no chunk within ``upload_idle_timeout_s`` (DEADLINE_EXCEEDED)."""


@dataclass(frozen=True)
class StreamLimits:
    """``[limits]`` of server.toml: concurrent streams per site and kind, the idle timeout
    between two chunks of an upload, and the worker pool (0 = :func:`worker_threads`)."""

    watch_streams_per_site: int = 2
    uploads_per_site: int = 2
    downloads_per_site: int = 2
    upload_idle_timeout_s: float = 60.0
    worker_threads: int = 0

    def per_site(self, kind: str) -> tuple[int, str]:
        """(limit, its server.toml key) of one stream kind."""
        if kind == "watch":
            return self.watch_streams_per_site, "watch_streams_per_site"
        if kind == "upload":
            return self.uploads_per_site, "uploads_per_site"
        if kind == "download":
            return self.downloads_per_site, "downloads_per_site"
        raise ValueError(f"unknown stream kind {kind!r}")


def worker_threads(limits: StreamLimits, *, sites: int) -> int:
    """The gRPC worker pool: the configured size, or enough for every site's streams and its
    one held GetCheckpoint (:meth:`afl.server.coordinator.Coordinator.log_checkpoint`) at once
    plus :data:`UNARY_WORKERS` (at least 32)."""
    if limits.worker_threads:
        return limits.worker_threads
    return max(32, sites * (_streams_per_site(limits) + 1) + UNARY_WORKERS)


def held_calls(limits: StreamLimits, *, sites: int) -> int:
    """How many GetCheckpoint answers the coordinator may hold at once: one per site, fewer
    when a configured pool leaves fewer threads beyond the sites' streams and
    :data:`UNARY_WORKERS` (then held calls never starve the calls that would end them)."""
    spare = worker_threads(limits, sites=sites) - sites * _streams_per_site(limits)
    return max(0, min(sites, spare - UNARY_WORKERS))


def _streams_per_site(limits: StreamLimits) -> int:
    return limits.watch_streams_per_site + limits.uploads_per_site + limits.downloads_per_site


class SiteStreams:
    """Open streams per (site, kind); thread-safe."""

    def __init__(self, limits: StreamLimits) -> None:
        self.limits = limits
        self._open: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def acquire(self, site: str, kind: str) -> None:
        """Take one of ``site``'s ``kind`` slots; :class:`LimitExceededError` when none is free."""
        limit, key = self.limits.per_site(kind)
        with self._lock:
            held = self._open.get((site, kind), 0)
            if held >= limit:
                raise LimitExceededError(
                    f"site {site!r} already holds {held} {kind} stream(s), the most allowed "
                    f"([limits] {key} = {limit})"
                )
            self._open[(site, kind)] = held + 1

    def release(self, site: str, kind: str) -> None:
        """Give back a slot taken by :meth:`acquire`."""
        with self._lock:
            held = self._open.get((site, kind), 0)
            if held <= 1:
                self._open.pop((site, kind), None)
            else:
                self._open[(site, kind)] = held - 1

    @contextmanager
    def hold(self, site: str, kind: str) -> Iterator[None]:
        """One slot for the duration of the ``with`` block."""
        self.acquire(site, kind)
        try:
            yield
        finally:
            self.release(site, kind)


_END = object()


def idle_limited(items: Iterator[T], *, idle_s: float, what: str) -> Iterator[T]:
    """The items of a blocking iterator, each within ``idle_s`` seconds of the previous one.

    A daemon thread reads ``items`` into a small queue (at most 4 items ahead of the consumer);
    when nothing arrives in time this raises :class:`IdleStreamError` in the consumer, so the
    gRPC worker is freed. Exceptions of ``items`` are re-raised here. When the consumer stops,
    the reader stops too (it ends once ``items`` does: gRPC ends it when the call terminates).
    """
    channel: queue.Queue[object] = queue.Queue(maxsize=4)
    stop = threading.Event()

    def hand_over(item: object) -> bool:
        while not stop.is_set():
            try:
                channel.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for item in items:
                if not hand_over(item):
                    return
        except Exception as exc:  # handed to the consumer, which re-raises it
            hand_over(exc)
            return
        hand_over(_END)

    threading.Thread(target=read, name="afl-upload-reader", daemon=True).start()
    try:
        while True:
            try:
                item = channel.get(timeout=idle_s)
            except queue.Empty:
                raise IdleStreamError(
                    f"{what}: no chunk within {idle_s:g} s ([limits] upload_idle_timeout_s); "
                    "the stream was closed"
                ) from None
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item  # type: ignore[misc]
    finally:
        stop.set()
