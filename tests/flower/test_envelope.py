"""The Flower envelope (afl.flower.envelope): what the relay and a site exchange survives its
record encoding unchanged, and a malformed record is refused with the cause."""

from __future__ import annotations

import pytest

from afl.flower.envelope import (
    Answer,
    Call,
    EnvelopeError,
    FromSite,
    Gate,
    ToSite,
    from_site,
    to_site,
)


def test_both_directions_round_trip_through_their_records() -> None:
    out = ToSite(
        "fed-1",
        results=(Answer("Enroll", b"req", (b"resp",)), Answer("Upload", b"c0", error="DENIED: x")),
        answers=(Answer("Download", b"d", (b"c0", b"c1", b"c2")), Answer("GetStatus", b"")),
    )
    assert to_site(out.record()) == out
    back = FromSite(
        "site-2",
        calls=(Call("RespondToPlan", b"\x01"), Call("Upload", b"\x02"), Call("Upload", b"\x03")),
        gate=Gate("stage", "r1-ab", 4, ("r0",)),
        gets=(Call("GetAdvertisedKeys", b"\x0a\x05r1-ab"),),
    )
    assert from_site(back.record()) == back


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        (lambda r: r.pop("gate.kind"), "no 'gate.kind'"),
        (lambda r: r.update({"gate.kind": "later"}), "none of"),
        (lambda r: r.update({"site_id": 3}), "must be str"),
        (lambda r: r.update({"calls.method": ["A", "B"]}), "2 methods, 1 requests"),
        (lambda r: r.update({"calls.request": ["text"]}), "must hold bytes"),
        (lambda r: r.update({"gate.stage": True}), "must be int"),
    ],
)
def test_a_malformed_site_record_is_refused_with_its_cause(change, cause) -> None:
    record = dict(FromSite("s", calls=(Call("A", b"x"),), gate=Gate("now")).record())
    change(record)
    with pytest.raises(EnvelopeError, match=cause):
        from_site(record)


def test_answer_counts_must_match_the_responses() -> None:
    record = dict(ToSite("f", answers=(Answer("Download", b"", (b"a", b"b")),)).record())
    record["answers.count"] = [3]
    with pytest.raises(EnvelopeError, match="counts do not match"):
        to_site(record)
    record["answers.count"] = [-1]
    with pytest.raises(EnvelopeError, match="must hold counts"):
        to_site(record)
