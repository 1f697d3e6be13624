"""afl.server.toml_text: what it writes parses back with the standard library's tomllib."""

from __future__ import annotations

import math
import tomllib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.server import toml_text

_keys = st.text(min_size=1, max_size=12)
_scalars = st.one_of(
    st.text(max_size=20),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.booleans(),
)
_values = st.one_of(
    _scalars, st.lists(st.integers(min_value=-(2**31), max_value=2**31), max_size=4)
)
_tables = st.dictionaries(_keys, _values, max_size=4)
_documents = st.dictionaries(
    _keys, st.one_of(_tables, st.dictionaries(_keys, _tables, min_size=1, max_size=2)), max_size=3
)


@settings(max_examples=60, deadline=None)
@given(document=_documents)
def test_documents_round_trip_through_tomllib(document: dict[str, Any]) -> None:
    assert tomllib.loads(toml_text.dumps(document, header="a\nb")) == document


def test_dotted_site_ids_stay_single_keys_and_special_floats_survive() -> None:
    text = toml_text.dumps(
        {"sites": {"site.c": {"role": "participant"}}, "p": {"eps": math.inf, "n": -math.inf}}
    )
    parsed = tomllib.loads(text)
    assert parsed["sites"] == {"site.c": {"role": "participant"}}
    assert parsed["p"]["eps"] == math.inf and parsed["p"]["n"] == -math.inf
    assert 'sites."site.c"' in text


@pytest.mark.parametrize("bad", [None, b"bytes", [[1]], {1: "x"}])
def test_unsupported_values_raise(bad: Any) -> None:
    with pytest.raises(toml_text.TomlWriteError):
        toml_text.dumps({"t": {"k": bad}} if not isinstance(bad, dict) else {"t": bad})
