"""The round config's digest (bound into every advert and consistency signature) is computed once
per config object: the value stays the canonical SHA-256 of the config's fields, any change of a
field (a new object) gives its own digest, and the cache is invisible to equality, hashing and
repr (docs/protocol.md §4.2)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

import pytest

from afl.crypto.canonical import DOMAIN_TAG, Field, canonical_encode
from afl.crypto.secagg.config import ReleaseSpec, RoundConfig, SparseGraph
from tests.crypto.secagg_helpers import make_federation, site_ids


def _sparse_config() -> RoundConfig:
    ids = site_ids(12)
    releases = [ReleaseSpec("gram", tuple(ids), 6, 1e4), ReleaseSpec("b", tuple(ids), 3, 1.0)]
    return RoundConfig.create(
        round_id="round-0001",
        cohort=ids,
        releases=releases,
        threshold=10,
        graph=SparseGraph(degree=6, share_threshold=4, colluders=2),
    )


def _by_hand(config: RoundConfig) -> bytes:
    """The digest written out from its definition (the docstring of RoundConfig.digest)."""
    fields: list[Field] = [
        DOMAIN_TAG,
        "round-config",
        config.round_id,
        config.round_salt,
        config.context,
        config.t,
        len(config.cohort),
        *config.cohort,
        len(config.releases),
        *(canonical_encode(r.fields()) for r in config.releases),
    ]
    if config.graph is not None:
        fields.append(canonical_encode(config.graph.fields()))
    return hashlib.sha256(canonical_encode(fields)).digest()


@pytest.mark.parametrize("sparse", [False, True])
def test_digest_is_the_canonical_hash_before_and_after_caching(sparse: bool) -> None:
    config = _sparse_config() if sparse else make_federation(n=5, threshold=3).config
    first = config.digest()
    assert first == _by_hand(config)
    assert config.digest() == first


def test_digest_is_computed_once_per_config(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _sparse_config()
    calls: list[int] = []

    def counting(fields: Sequence[Field]) -> bytes:
        calls.append(1)
        return canonical_encode(fields)

    monkeypatch.setattr("afl.crypto.secagg.config.canonical_encode", counting)
    config.digest()
    once = len(calls)
    assert once > 0
    for _ in range(5):
        config.digest()
    assert len(calls) == once


def test_a_changed_config_has_its_own_digest() -> None:
    config = _sparse_config()
    cached = config.digest()
    changed = [
        replace(config, threshold=9),
        replace(config, round_salt=bytes(32)),
        replace(config, round_id="round-0002"),
        replace(config, graph=SparseGraph(degree=6, share_threshold=5, colluders=2)),
        replace(config, context=hashlib.sha256(b"another plan").digest()),
        replace(config, cohort=config.cohort[::-1]),  # sorted again: the same config
    ]
    digests = [c.digest() for c in changed]
    assert digests[:5] == [_by_hand(c) for c in changed[:5]]
    assert len({cached, *digests[:5]}) == 6
    assert digests[5] == cached


def test_the_cache_is_invisible_to_equality_hash_and_repr() -> None:
    config = _sparse_config()
    twin = replace(config)
    config.digest()
    assert config == twin
    assert hash(config) == hash(twin)
    assert repr(config) == repr(twin)
    assert "digest" not in repr(config)
