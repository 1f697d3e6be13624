"""The coordinator's side of the Flower app: afl-server's request handling, driven by Flower
messages instead of gRPC calls (docs/flower.md §2, docs/architecture.md §1).

The relay owns one :class:`~afl.server.coordinator.Coordinator` (round machine, release plan and
leakage audit, aggregation modes, solve, signed model, store) and answers every request through
:class:`RelayServicer`, afl-server's own :class:`~afl.server.servicer.CoordinatorServicer` with
one difference: the caller's site id is the site bound to the Flower node, not the name in a TLS
certificate. Everything else — the request checks of the shared flow and of each mode, stream
limits, chunk framing, the one mapping of errors to status codes — is the daemon's code.

Binding. A node first says which site it is; until that site's enrolment succeeds through this
node (``Enroll``: the provisioned identity key signs a fresh challenge and every declared field),
the node may only call ``GetEnrolChallenge`` and ``Enroll``. A successful enrolment binds the
node to the site (a later proof from another node moves the binding there).

Driving. Each reply of a site carries its calls (made at once, as the site) and a gate with the
requests to answer when it opens (:mod:`afl.flower.envelope`): the relay sends the next message
as soon as the round machine reaches the gate, so every Flower round trip advances the site by one
stage of the round and nothing waits on a timer. The relay only waits where Flower gives it no
signal: replies are pulled from the Grid with a back-off from 1 ms to 50 ms, and stage deadlines
are applied by :meth:`Coordinator.tick` on every turn. It stops when the run ended and no message
is in flight (after ``grace_s``, what is still in flight is abandoned), or after ``max_wait_s``
(the run is aborted; nothing is released).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError, Message

from afl.flower.envelope import Answer, Call, FromSite, Gate, ToSite, job_key
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import load_config
from afl.server.coordinator import Coordinator
from afl.server.daemon.main import load_identity_key
from afl.server.servicer import CoordinatorServicer
from afl.server.store import Store

__all__ = [
    "ENROLMENT_METHODS",
    "CallContext",
    "Relay",
    "RelayError",
    "RelayOutcome",
    "RelayServicer",
    "Reply",
    "Transport",
    "error_text",
    "serve_federation",
]

log = logging.getLogger("afl.flower.relay")

_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
#: What a node may call before its site's enrolment succeeded through it.
ENROLMENT_METHODS = frozenset({"GetEnrolChallenge", "Enroll"})
#: Not relayed: round events reach a site through its gates.
_NOT_RELAYED = frozenset({"WatchRounds"})
MIN_PAUSE_S, MAX_PAUSE_S = 0.001, 0.05
NODE_REFRESH_S = 0.25
_WAITING = (pb.ROUND_STAGE_UNSPECIFIED, pb.ROUND_STAGE_WAITING_FOR_PARTICIPANTS)


class RelayError(Exception):
    """A relayed call refused (the status code and reason the gRPC service would return)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


def error_text(code: grpc.StatusCode, details: str) -> str:
    """How a refusal travels in an :class:`~afl.flower.envelope.Answer`."""
    return f"{code.name}: {details}"


class CallContext:
    """The part of ``grpc.ServicerContext`` the servicer uses, for one call as ``site_id``."""

    def __init__(self, site_id: str) -> None:
        self.site_id = site_id
        self._callbacks: list[Callable[[], object]] = []

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise RelayError(code, details)

    def add_callback(self, callback: Callable[[], object]) -> bool:
        self._callbacks.append(callback)
        return True

    def is_active(self) -> bool:
        return True

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def close(self) -> None:
        """The call ended: release what it held (stream slots)."""
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


class RelayServicer(CoordinatorServicer):
    """afl-server's servicer; the caller is the site bound to the Flower node."""

    def _identify(self, context: Any) -> str:
        site: str = context.site_id
        return site


def _request_class(method: str) -> type[Message]:
    descriptor = _SERVICE.methods_by_name.get(method)
    if descriptor is None or method in _NOT_RELAYED:
        raise RelayError(grpc.StatusCode.UNIMPLEMENTED, f"{method!r} is not relayed")
    cls: type[Message] = message_factory.GetMessageClass(descriptor.input_type)
    return cls


def _parse(method: str, data: bytes) -> Message:
    try:
        return _request_class(method).FromString(data)
    except DecodeError as exc:
        raise RelayError(
            grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request does not parse"
        ) from exc


def _chunk(data: bytes) -> pb.UploadChunk:
    try:
        return pb.UploadChunk.FromString(data)
    except DecodeError as exc:
        raise RelayError(
            grpc.StatusCode.INVALID_ARGUMENT, "Upload: a chunk does not parse"
        ) from exc


@dataclass(frozen=True)
class Reply:
    """A node's reply to the message ``message_id``: its content, or why there is none."""

    message_id: str
    node_id: int
    content: FromSite | None
    error: str = ""


class Transport(Protocol):
    """How the relay reaches the nodes (a Flower Grid in :mod:`afl.flower.server_app`)."""

    def node_ids(self) -> list[int]:
        """The nodes connected now."""
        ...

    def push(self, messages: list[tuple[int, ToSite]]) -> list[str]:
        """Send each message to its node; their message ids, in order."""
        ...

    def pull(self, message_ids: Collection[str]) -> list[Reply]:
        """The replies that arrived to those messages (without waiting)."""
        ...


@dataclass
class _Node:
    node_id: int
    site: str = ""
    bound: bool = False
    inflight: str = ""
    gate: Gate | None = None
    gets: tuple[Call, ...] = ()
    results: list[Answer] = field(default_factory=list)
    dead: bool = False


@dataclass(frozen=True)
class RelayOutcome:
    """How the run the relay served ended."""

    run_id: str
    state: str
    reason: str
    sites: tuple[str, ...]
    messages: int
    seconds: float


class Relay:
    """Serves one afl run to the Flower nodes (module docstring)."""

    def __init__(
        self,
        coordinator: Coordinator,
        transport: Transport,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.coordinator = coordinator
        self.transport = transport
        self.servicer = RelayServicer(coordinator)
        self.federation_id = coordinator.config.federation_id
        self.nodes: dict[int, _Node] = {}
        self.messages = 0
        self._clock, self._sleep = clock, sleep
        self._next_refresh = 0.0

    # --- calls as a site -----------------------------------------------------------------------

    def invoke(self, site: str, method: str, requests: list[bytes]) -> tuple[bytes, ...]:
        """Call ``method`` as ``site`` through the servicer; its response message(s)."""
        context = CallContext(site)
        try:
            if method == "Upload":
                chunks = [_chunk(r) for r in requests]
                return (self.servicer.Upload(iter(chunks), context).SerializeToString(),)
            if len(requests) != 1:
                raise RelayError(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: one request")
            request = _parse(method, requests[0])
            response = getattr(self.servicer, method)(request, context)
            if isinstance(response, Iterator):  # a server stream (Download)
                return tuple(m.SerializeToString() for m in response)
            data: bytes = response.SerializeToString()
            return (data,)
        finally:
            context.close()

    def _answer(self, node: _Node, method: str, requests: list[bytes]) -> Answer:
        first = requests[0] if requests else b""
        if not node.bound and method not in ENROLMENT_METHODS:
            why = f"{method}: node {node.node_id} has not enrolled as {node.site or 'a site'}"
            return Answer(method, first, error=error_text(grpc.StatusCode.PERMISSION_DENIED, why))
        try:
            response = self.invoke(node.site, method, requests)
        except RelayError as exc:
            return Answer(method, first, error=error_text(exc.code, exc.details))
        if method == "Enroll":
            self._bind(node)
        return Answer(method, first, response)

    def _bind(self, node: _Node) -> None:
        for other in self.nodes.values():
            if other is not node and other.bound and other.site == node.site:
                other.bound = False
                log.warning(
                    "site %s moved from node %d to %d", node.site, other.node_id, node.node_id
                )
        node.bound = True
        log.info("node %d enrolled as %s", node.node_id, node.site)

    def _calls(self, node: _Node, calls: Iterable[Call]) -> None:
        """Make ``calls`` as the node's site, in order; an Upload is one stream of chunks."""
        stream: list[bytes] = []
        for call in calls:
            if call.method != "Upload":
                if stream:
                    node.results.append(self._answer(node, "Upload", stream))
                    stream = []
                node.results.append(self._answer(node, call.method, [call.request]))
                continue
            stream.append(call.request)
            try:
                chunk = pb.UploadChunk.FromString(call.request)
                last = chunk.chunk_index + 1 >= chunk.total_chunks
            except DecodeError:
                last = True  # refused as a whole (the servicer's parse)
            if last:
                node.results.append(self._answer(node, "Upload", stream))
                stream = []
        if stream:
            node.results.append(self._answer(node, "Upload", stream))

    # --- gates ----------------------------------------------------------------------------------

    def _open(self, node: _Node) -> bool:
        """Whether the node's gate is open (module docstring)."""
        gate = node.gate
        if gate is None or node.inflight or node.dead or gate.kind == "end":
            return False
        if gate.kind == "now" or not node.bound:
            return True
        if gate.kind == "jobs":
            return self._has_jobs(node.site, gate.done)
        if gate.kind == "stage":
            status = self.coordinator.status(node.site, gate.round_id)
            return not status.HasField("round") or status.round.stage >= gate.stage
        status = self.coordinator.status(node.site)
        if not status.HasField("round"):
            return False
        r = status.round
        missed = r.stage >= pb.ROUND_STAGE_SOLVING and not r.caller_accepted_plan
        return (
            r.round_id not in gate.done
            and r.stage not in (*_WAITING, pb.ROUND_STAGE_ABORTED)
            and node.site in r.participants
            and not missed
        )

    def _has_jobs(self, site: str, done: Collection[str]) -> bool:
        """Whether the coordinator lists a decryption job for ``site`` not in ``done``."""
        try:
            data = self.invoke(site, "GetDecryptionJobs", [cpb.RoundRef().SerializeToString()])
        except RelayError:
            return False
        jobs = pb.DecryptionJobs.FromString(data[0])
        return any(job_key(jobs.round_id, j.release_name) not in done for j in jobs.jobs)

    def _release(self, nodes: list[_Node]) -> None:
        """Send each node its next message: the results of its calls, the answers to its gets."""
        if not nodes:
            return
        messages = []
        for node in nodes:
            answers = tuple(self._answer(node, g.method, [g.request]) for g in node.gets)
            messages.append(
                (node.node_id, ToSite(self.federation_id, tuple(node.results), answers))
            )
            node.results, node.gate, node.gets = [], None, ()
        for node, message_id in zip(nodes, self.transport.push(messages), strict=True):
            node.inflight = message_id
        if log.isEnabledFor(logging.DEBUG):
            log.debug("sent to %s", ", ".join(n.site or str(n.node_id) for n in nodes))
        self.messages += len(nodes)

    # --- the loop -------------------------------------------------------------------------------

    def _welcome(self) -> bool:
        """Greet nodes that connected since the last look (at most every NODE_REFRESH_S)."""
        now = self._clock()
        if now < self._next_refresh:
            return False
        self._next_refresh = now + NODE_REFRESH_S
        new = [n for n in self.transport.node_ids() if n not in self.nodes]
        for node_id in new:
            self.nodes[node_id] = _Node(node_id, gate=Gate("now"))
        self._release([self.nodes[n] for n in new])
        return bool(new)

    def _receive(self) -> bool:
        inflight = {n.inflight: n for n in self.nodes.values() if n.inflight and not n.dead}
        if not inflight:
            return False
        replies = self.transport.pull(list(inflight))
        for reply in replies:
            node = inflight.get(reply.message_id)
            if node is None or node.node_id != reply.node_id:
                log.warning("a reply from node %d to no message of it", reply.node_id)
                continue
            node.inflight = ""
            content = reply.content
            log.debug("reply from %s", node.site or node.node_id)
            if content is None:
                node.dead = True
                log.error("node %d (%s) failed: %s", node.node_id, node.site or "?", reply.error)
                continue
            if node.site and content.site_id != node.site:
                node.dead = True
                log.error(
                    "node %d said it is %s, then %s", node.node_id, node.site, content.site_id
                )
                continue
            node.site = content.site_id
            self._calls(node, content.calls)
            node.gate, node.gets = content.gate, content.gets
        return bool(replies)

    def _run_state(self, run_id: str) -> tuple[str, str]:
        with self.coordinator.lock:
            row = self.coordinator.machine.run(run_id).row
        return row.state, row.reason

    def current_run(self) -> str:
        """The active run (a new one from server.toml's [round] when none is active)."""
        machine = self.coordinator.machine
        with self.coordinator.lock:
            active = machine.active_run()
            if active is None:
                active = machine.submit_run("flower", {}, submitted_by="afl.flower")
            return active.run_id

    def serve(self, *, max_wait_s: float = 3600.0, grace_s: float = 60.0) -> RelayOutcome:
        """Run the active afl run to its end over the transport (module docstring)."""
        run_id = self.current_run()
        start = self._clock()
        pause, ended_at = MIN_PAUSE_S, None
        log.info("serving run %s over Flower", run_id)
        while True:
            progressed = self._welcome()
            progressed |= self._receive()
            self.coordinator.tick()
            ready = [node for node in self.nodes.values() if self._open(node)]
            self._release(ready)
            progressed |= bool(ready)
            state, reason = self._run_state(run_id)
            now = self._clock()
            if state in ("published", "aborted", "failed"):
                ended_at = now if ended_at is None else ended_at
                busy = [n for n in self.nodes.values() if n.inflight and not n.dead]
                if not busy or now - ended_at > grace_s:
                    break
            elif now - start > max_wait_s:
                with self.coordinator.lock:
                    self.coordinator.machine.abort_run(
                        run_id, reason=f"no end within {max_wait_s:g} s", by="afl.flower"
                    )
                continue
            if progressed:
                pause = MIN_PAUSE_S
            else:
                self._sleep(pause)
                pause = min(2 * pause, MAX_PAUSE_S)
        sites = tuple(sorted(n.site for n in self.nodes.values() if n.bound))
        return RelayOutcome(run_id, state, reason, sites, self.messages, self._clock() - start)


def serve_federation(
    server_config: str | os.PathLike[str], transport: Transport, *, max_wait_s: float = 3600.0
) -> RelayOutcome:
    """Open the coordinator of ``server_config`` (server.toml: kit, [round], state folder) and
    serve its active run over ``transport`` (a new run from [round] when none is active)."""
    config = load_config(server_config)
    store = Store(config.state_dir, federation_id=config.federation_id)
    try:
        coordinator = Coordinator(config, store, load_identity_key(config))
        return Relay(coordinator, transport).serve(max_wait_s=max_wait_s)
    finally:
        store.close()
