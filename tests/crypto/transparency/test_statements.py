"""The federation log's statement forms (afl.crypto.transparency.statements, docs/protocol.md
§11a): an opening signs the digest of its release, and the release is a statement of its own."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from afl.crypto.transparency.statements import (
    StatementError,
    decode_statement,
    opened_release_statement,
    opening_signed_fields,
    opening_statement,
    release_sha256,
)

FED = "fed-statements"

_sites = st.lists(st.from_regex(r"site-[0-9]{1,3}", fullmatch=True), min_size=1, max_size=6)
_releases = st.fixed_dictionaries(
    {
        "round_id": st.text(min_size=1, max_size=12),
        "run_id": st.text(max_size=12),
        "survivors": _sites,
        "releases": st.lists(
            st.fixed_dictionaries(
                {
                    "name": st.text(max_size=10),
                    "kind": st.sampled_from(["STATISTIC_KIND_GRAM", "STATISTIC_KIND_CLASS_VECTOR"]),
                    "classes": st.lists(st.text(max_size=6), max_size=3),
                    "members": _sites,
                }
            ),
            max_size=3,
        ),
    }
)


@given(_releases)
def test_a_release_s_digest_is_sha256_of_its_sorted_compact_json_whatever_the_key_order(
    release: dict[str, object],
) -> None:
    oracle = hashlib.sha256(
        json.dumps(release, sort_keys=True, separators=(",", ":")).encode("utf-8")
    ).digest()
    reordered = dict(reversed(list(release.items())))
    assert release_sha256(release) == oracle == release_sha256(reordered)


@given(_releases)
def test_an_opened_release_decodes_to_its_release_in_its_own_federation_only(
    release: dict[str, object],
) -> None:
    entry = opened_release_statement(federation=FED, release=release)
    assert decode_statement(entry, federation=FED) == ("opened-release", release)
    assert opened_release_statement(federation=FED, release=dict(reversed(release.items()))) == (
        entry
    )  # one release, one leaf: the log holds it once
    with pytest.raises(StatementError, match="not of 'fed-other'"):
        decode_statement(entry, federation="fed-other")


def test_an_opening_binds_its_round_plan_mode_and_release_digest() -> None:
    base = {
        "federation": FED,
        "site": "site-1",
        "round_id": "r1",
        "plan_sha256": b"\1" * 32,
        "mode": "mask",
        "release_sha256": b"\2" * 32,
    }
    signed = opening_signed_fields(**base)  # type: ignore[arg-type]
    changes = {
        "federation": "fed-other",
        "site": "site-2",
        "round_id": "r2",
        "plan_sha256": b"\3" * 32,
        "mode": "ckks",
        "release_sha256": b"\4" * 32,
    }
    for field, value in changes.items():
        assert opening_signed_fields(**{**base, field: value}) != signed, field  # type: ignore[arg-type]
    entry = opening_statement(
        federation=FED,
        site="site-1",
        round_id="r1",
        plan_sha256=b"\1" * 32,
        mode="mask",
        release_sha256=b"\2" * 32,
        signature=b"\5" * 64,
    )
    kind, fields = decode_statement(entry, federation=FED)
    assert kind == "opening" and fields == {
        "site": "site-1",
        "round_id": "r1",
        "plan_sha256": (b"\1" * 32).hex(),
        "mode": "mask",
        "release_sha256": (b"\2" * 32).hex(),
        "signature": (b"\5" * 64).hex(),
    }
    assert len(entry) < 600  # O(1) in the number of survivors: no release inside
