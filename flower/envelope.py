"""What one Flower message carries between the coordinator's relay and a site (docs/flower.md §2).

Every message is a ``query.afl`` message whose content holds one ``ConfigRecord`` named ``afl``;
its values are the afl protocol messages, serialized exactly as afl's gRPC service sends them
(coordinator.proto), with the RPC method they belong to:

    coordinator -> site  (:class:`ToSite`)
        results   the answers to the calls of the site's previous reply, in order (an
                  ``Upload`` stream counts once: its receipt)
        answers   the answers to the site's ``gets``, taken when its gate opened

    site -> coordinator  (:class:`FromSite`)
        site_id   the site the node says it is (bound to the node by a verified enrolment)
        calls     requests to make now, as this site (an ``Upload`` is its chunk stream)
        gate      when the next message is due: ``now``; ``stage`` (the round reached a stage,
                  or ended); ``round`` (a round the site takes part in opened, other than those
                  in ``done``); ``jobs`` (the CKKS decryptor: the coordinator lists a decryption
                  job not in ``done``, by :func:`job_key`); ``end`` (nothing more)
        gets      requests whose answers the next message carries (read when the gate opens)

An answer is one response message, or the messages of a stream (``Download``); a refused call or
get carries ``"<grpc status name>: <reason>"`` instead. Decoding checks every key, type and count
and raises :class:`EnvelopeError` with the cause; nothing here trusts what it decodes beyond
that (the relay and the site check the protocol messages themselves).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "MESSAGE_TYPE",
    "RECORD",
    "Answer",
    "Call",
    "EnvelopeError",
    "FromSite",
    "Gate",
    "ToSite",
    "Value",
    "from_site",
    "job_key",
    "to_site",
]

#: The Flower message type of every afl message (the ClientApp's ``@app.query("afl")``).
MESSAGE_TYPE = "query.afl"
#: Name of the ConfigRecord holding the envelope in the message content.
RECORD = "afl"
GATES = ("now", "stage", "round", "jobs", "end")

Value = str | int | bytes | list[str] | list[bytes] | list[int]


def job_key(round_id: str, release_name: str) -> str:
    """How a decryption job is named in a ``jobs`` gate's ``done``."""
    return f"{round_id}/{release_name}"


class EnvelopeError(ValueError):
    """A Flower message does not hold a well-formed afl envelope."""


@dataclass(frozen=True)
class Call:
    """One request: the RPC method and its serialized request message."""

    method: str
    request: bytes


@dataclass(frozen=True)
class Answer:
    """The answer to a :class:`Call`: its response message(s), or ``error``."""

    method: str
    request: bytes
    response: tuple[bytes, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class Gate:
    """When the site's next message is due (module docstring)."""

    kind: str
    round_id: str = ""
    stage: int = 0
    done: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToSite:
    """A message from the coordinator to a site."""

    federation_id: str
    results: tuple[Answer, ...] = ()
    answers: tuple[Answer, ...] = ()

    def record(self) -> dict[str, Value]:
        return {
            "federation_id": self.federation_id,
            **_answers_record("results", self.results),
            **_answers_record("answers", self.answers),
        }


@dataclass(frozen=True)
class FromSite:
    """A site's reply."""

    site_id: str
    calls: tuple[Call, ...] = ()
    gate: Gate = Gate("end")
    gets: tuple[Call, ...] = ()

    def record(self) -> dict[str, Value]:
        return {
            "site_id": self.site_id,
            "calls.method": [c.method for c in self.calls],
            "calls.request": [c.request for c in self.calls],
            "gate.kind": self.gate.kind,
            "gate.round": self.gate.round_id,
            "gate.stage": self.gate.stage,
            "gate.done": list(self.gate.done),
            "gets.method": [c.method for c in self.gets],
            "gets.request": [c.request for c in self.gets],
        }


def _answers_record(prefix: str, answers: Sequence[Answer]) -> dict[str, Value]:
    return {
        f"{prefix}.method": [a.method for a in answers],
        f"{prefix}.request": [a.request for a in answers],
        f"{prefix}.error": [a.error for a in answers],
        f"{prefix}.count": [len(a.response) for a in answers],
        f"{prefix}.response": [r for a in answers for r in a.response],
    }


def _get(record: Mapping[str, object], key: str, kind: type) -> object:
    if key not in record:
        raise EnvelopeError(f"the afl record has no {key!r}")
    value = record[key]
    if kind is list:
        if not isinstance(value, list):
            raise EnvelopeError(f"afl record {key!r} must be a list")
    elif not isinstance(value, kind) or isinstance(value, bool):
        raise EnvelopeError(f"afl record {key!r} must be {kind.__name__}")
    return value


def _strs(record: Mapping[str, object], key: str) -> list[str]:
    items = _get(record, key, list)
    assert isinstance(items, list)
    if not all(isinstance(x, str) for x in items):
        raise EnvelopeError(f"afl record {key!r} must hold strings")
    return list(items)


def _bytes(record: Mapping[str, object], key: str) -> list[bytes]:
    items = _get(record, key, list)
    assert isinstance(items, list)
    if not all(isinstance(x, bytes) for x in items):
        raise EnvelopeError(f"afl record {key!r} must hold bytes")
    return list(items)


def _calls(record: Mapping[str, object], prefix: str) -> tuple[Call, ...]:
    methods, requests = _strs(record, f"{prefix}.method"), _bytes(record, f"{prefix}.request")
    if len(methods) != len(requests):
        raise EnvelopeError(
            f"afl record {prefix}: {len(methods)} methods, {len(requests)} requests"
        )
    return tuple(Call(m, r) for m, r in zip(methods, requests, strict=True))


def _answers(record: Mapping[str, object], prefix: str) -> tuple[Answer, ...]:
    calls = _calls(record, prefix)
    errors = _strs(record, f"{prefix}.error")
    counts = _get(record, f"{prefix}.count", list)
    assert isinstance(counts, list)
    responses = _bytes(record, f"{prefix}.response")
    if len(errors) != len(calls) or len(counts) != len(calls):
        raise EnvelopeError(f"afl record {prefix}: the lists differ in length")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise EnvelopeError(f"afl record {prefix}.count must hold counts")
    if sum(counts) != len(responses):
        raise EnvelopeError(f"afl record {prefix}: counts do not match the responses")
    out, at = [], 0
    for call, error, n in zip(calls, errors, counts, strict=True):
        out.append(Answer(call.method, call.request, tuple(responses[at : at + n]), error))
        at += n
    return tuple(out)


def to_site(record: Mapping[str, object]) -> ToSite:
    """Decode a coordinator's message (:class:`EnvelopeError` names what is wrong)."""
    federation = _get(record, "federation_id", str)
    assert isinstance(federation, str)
    return ToSite(federation, _answers(record, "results"), _answers(record, "answers"))


def from_site(record: Mapping[str, object]) -> FromSite:
    """Decode a site's reply (:class:`EnvelopeError` names what is wrong)."""
    site, kind = _get(record, "site_id", str), _get(record, "gate.kind", str)
    stage, round_id = _get(record, "gate.stage", int), _get(record, "gate.round", str)
    assert isinstance(site, str) and isinstance(kind, str)
    assert isinstance(stage, int) and isinstance(round_id, str)
    if kind not in GATES:
        raise EnvelopeError(f"afl record gate.kind {kind!r} is none of {GATES}")
    gate = Gate(kind, round_id, stage, tuple(_strs(record, "gate.done")))
    return FromSite(site, _calls(record, "calls"), gate, _calls(record, "gets"))
