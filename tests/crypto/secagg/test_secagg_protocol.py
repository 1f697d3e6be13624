"""Secure aggregation state machines, honest runs (docs/protocol.md §4.2): decoded masked aggregates
equal the plaintext float64 sums; sub-cohort releases; stage, round, sender and duplicate checks;
stored uploads independent of the inputs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afl.crypto.errors import (
    DuplicateMessageError,
    ProtocolError,
    RoundMismatchError,
    SecAggConfigError,
    StageError,
    UnknownParticipantError,
)
from afl.crypto.secagg.client import SecAggClient
from afl.crypto.secagg.config import ReleaseSpec, RoundConfig, default_threshold
from afl.crypto.secagg.local import run_local_round
from afl.crypto.secagg.messages import (
    ConsistencyRequest,
    KeyDirectory,
    MaskedInputUpload,
    RoutedShares,
    Stage,
)
from afl.crypto.secagg.server import SecAggServer
from tests.crypto.secagg_helpers import (
    Federation,
    assert_sum_matches,
    exact_sum,
    honest_round,
    make_federation,
    site_ids,
)


def test_full_round_sums_equal_plaintext_sums() -> None:
    fed = make_federation(n=5)
    report = run_local_round(config=fed.config, identity_keys=fed.keys, inputs=fed.inputs)
    result = report.result
    assert result.withheld == {} and result.dropped == ()
    assert set(result.sums) == {"gram", "b"}
    for name in ("gram", "b"):
        spec = fed.config.release(name)
        assert result.contributors[name] == spec.members
        assert_sum_matches(
            result.sums[name], exact_sum(fed.inputs, name, spec.members), spec.codec()
        )
    assert report.server.stage is Stage.DONE
    assert all(v > 0 for v in report.bytes_up.values())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(min_value=3, max_value=6), seed=st.integers(0, 2**32 - 1))
def test_property_masked_sum_equals_plaintext_sum(n: int, seed: int) -> None:
    fed = make_federation(n=n, seed=seed)
    result = run_local_round(config=fed.config, identity_keys=fed.keys, inputs=fed.inputs).result
    for name, decoded in result.sums.items():
        spec = fed.config.release(name)
        assert_sum_matches(decoded, exact_sum(fed.inputs, name, spec.members), spec.codec())


def test_multiple_releases_with_different_sub_cohorts() -> None:
    ids = site_ids(7)
    plan = [
        ("gram", ids, 15, 1e4),
        ("b/class-0", ids[:3], 5, 1.0),
        ("b/class-1", ids[2:6], 5, 1.0),
        ("b/class-2", ids[1::2], 5, 2.0),
    ]
    fed = make_federation(n=7, releases=plan, seed=3)
    result = run_local_round(config=fed.config, identity_keys=fed.keys, inputs=fed.inputs).result
    assert result.withheld == {}
    for name, members, _, _ in plan:
        spec = fed.config.release(name)
        assert result.contributors[name] == tuple(sorted(members))
        assert_sum_matches(result.sums[name], exact_sum(fed.inputs, name, members), spec.codec())


def test_default_threshold_is_a_majority() -> None:
    assert [default_threshold(n) for n in (2, 3, 4, 5, 8, 64)] == [2, 2, 3, 3, 5, 33]
    assert make_federation(n=8).config.t == 5
    assert make_federation(n=8, threshold=7).config.t == 7


def test_config_rejects_bad_plans() -> None:
    ids = site_ids(4)
    spec = ReleaseSpec("gram", tuple(ids), 4, 1.0)
    with pytest.raises(SecAggConfigError, match="threshold"):
        RoundConfig.create(round_id="r", cohort=ids, releases=[spec], threshold=5)
    with pytest.raises(SecAggConfigError, match="outside the cohort"):
        RoundConfig.create(round_id="r", cohort=ids[:3], releases=[spec])
    with pytest.raises(SecAggConfigError, match="minimum cohort"):
        ReleaseSpec("b", ("site-00", "site-01"), 3, 1.0)
    with pytest.raises(SecAggConfigError, match="share a name"):
        RoundConfig.create(round_id="r", cohort=ids, releases=[spec, spec])
    with pytest.raises(SecAggConfigError, match=r"overflows|does not fit"):
        ReleaseSpec("huge", tuple(ids), 3, 1e300)


def _started(n: int = 4) -> tuple[SecAggServer, dict[str, SecAggClient], Federation]:
    fed = make_federation(n=n)
    server, clients = honest_round(fed)
    return server, clients, fed


def test_server_rejects_wrong_stage_round_sender_unknown_and_duplicates() -> None:
    server, clients, _ = _started()
    adverts = {s: c.advertise_keys() for s, c in clients.items()}
    a, b = "site-00", "site-01"
    server.receive(adverts[a], sender=a)
    with pytest.raises(DuplicateMessageError):
        server.receive(adverts[a], sender=a)
    with pytest.raises(ProtocolError, match="claims to be"):
        server.receive(adverts[b], sender="site-02")
    intruder = replace(adverts[b], site_id="intruder")
    with pytest.raises(UnknownParticipantError, match="not in the round's cohort"):
        server.receive(intruder, sender="intruder")
    with pytest.raises(StageError, match="belongs to stage masked-input"):
        server.receive(MaskedInputUpload("round-0001", b, ()), sender=b)
    with pytest.raises(RoundMismatchError):
        server.receive(replace(adverts[b], round_id="round-9999"), sender=b)
    with pytest.raises(StageError, match="cannot close"):
        server.close_masked_input()
    for s in ("site-01", "site-02"):
        server.receive(adverts[s], sender=s)
    server.close_advertise()  # site-03 never advertised: dropped
    with pytest.raises(StageError, match="belongs to stage advertise-keys"):
        server.receive(adverts["site-03"], sender="site-03")


def test_dropped_site_cannot_rejoin_and_bad_signature_is_rejected() -> None:
    server, clients, fed = _started()
    adverts = {s: c.advertise_keys() for s, c in clients.items()}
    forged = replace(adverts["site-02"], mask_public=adverts["site-01"].mask_public)
    with pytest.raises(ProtocolError, match="does not verify"):
        server.receive(forged, sender="site-02")
    for s in ("site-00", "site-01", "site-02"):
        server.receive(adverts[s], sender=s)
    directory = server.close_advertise()
    assert [a.site_id for a in directory.adverts] == ["site-00", "site-01", "site-02"]
    with pytest.raises(StageError):  # site-03 missed AdvertiseKeys; its client is stuck there
        clients["site-03"].masked_input(RoutedShares("round-0001", "site-03", ()))
    uploads = {s: clients[s].share_keys(directory) for s in ("site-00", "site-01", "site-02")}
    with pytest.raises(UnknownParticipantError, match="dropped out"):
        server.receive(replace(uploads["site-00"], site_id="site-03"), sender="site-03")
    server.receive(uploads["site-00"], sender="site-00")
    assert clients["site-00"].stage is Stage.MASKED_INPUT
    assert fed.config.t == 3


def test_client_checks_its_own_stage_and_round() -> None:
    _, clients, _ = _started()
    c = clients["site-00"]
    with pytest.raises(StageError):
        c.consistency_check(ConsistencyRequest("round-0001", ("site-00",)))
    advert = c.advertise_keys()
    with pytest.raises(StageError):
        c.advertise_keys()
    with pytest.raises(RoundMismatchError):
        c.share_keys(KeyDirectory("round-0002", (advert,)))


def test_stored_uploads_are_independent_of_the_statistics() -> None:
    """Near-zero correlation between each masked upload y_i the server receives (and the
    daemon stores) and the true x_i, and uniform top bits: nothing individual rests on the
    server, which itself keeps only the running sum per release."""
    n, d = 4, 4096
    ids = site_ids(n)
    fed = make_federation(n=n, releases=[("gram", ids, d, 1e4)], seed=11)
    # Strongly structured inputs: a ramp, so a leak would correlate strongly.
    for i, s in enumerate(ids):
        fed.inputs[s]["gram"] = np.linspace(-4e3, 4e3, d) * (1 + i) / n
    server, by_site = honest_round(fed)
    clients = list(by_site.values())  # the cohort's order: ids
    for c in clients:
        server.receive(c.advertise_keys(), sender=c.site_id)
    directory = server.close_advertise()
    for c in clients:
        server.receive(c.share_keys(directory), sender=c.site_id)
    routed = server.close_share_keys()
    stored = {}
    for c in clients:
        upload = c.masked_input(routed[c.site_id])
        stored[c.site_id] = dict(upload.vectors)
        server.receive(upload, sender=c.site_id)
    server.close_masked_input()
    assert set(server.held_sums) == {"gram"}
    codec = fed.config.release("gram").codec()
    bound = 4.0 / np.sqrt(d)  # |corr| of independent vectors is ~N(0, 1/d)
    for s in ids:
        y = stored[s]["gram"]
        x_enc = codec.encode(fed.inputs[s]["gram"])
        assert not np.array_equal(y, x_enc)
        y_signed = y.view(np.int64).astype(np.float64)
        assert abs(np.corrcoef(y_signed, fed.inputs[s]["gram"])[0, 1]) < bound
        assert abs(np.corrcoef(y_signed, x_enc.view(np.int64).astype(np.float64))[0, 1]) < bound
        top = (y >> np.uint64(60)).astype(np.int64)  # 16 buckets, uniform under masking
        counts = np.bincount(top, minlength=16)
        chi2 = float(np.sum((counts - d / 16) ** 2 / (d / 16)))
        assert chi2 < 60.0  # χ²(15) has p ≈ 1e-7 at 60


def test_server_rejects_malformed_bodies() -> None:
    server, clients, fed = _started()
    for s, c in clients.items():
        server.receive(c.advertise_keys(), sender=s)
    directory = server.close_advertise()
    uploads = {s: c.share_keys(directory) for s, c in clients.items()}
    short = replace(uploads["site-00"], shares=uploads["site-00"].shares[1:])
    with pytest.raises(ProtocolError, match="one share bundle to each of U1"):
        server.receive(short, sender="site-00")
    for s, u in uploads.items():
        server.receive(u, sender=s)
    routed = server.close_share_keys()
    masked = clients["site-01"].masked_input(routed["site-01"])
    name, y = masked.vectors[0]
    truncated = replace(masked, vectors=((name, y[:-1]), *masked.vectors[1:]))
    with pytest.raises(ProtocolError, match="uint64 vector of length"):
        server.receive(truncated, sender="site-01")
    with pytest.raises(ProtocolError, match="exactly its releases"):
        server.receive(replace(masked, vectors=masked.vectors[:1]), sender="site-01")
    server.receive(masked, sender="site-01")
    assert fed.config.t == 3


def test_protocol_errors_share_one_base_class() -> None:
    from afl.crypto import errors

    for name in (
        "StageError",
        "UnknownParticipantError",
        "DuplicateMessageError",
        "RoundMismatchError",
        "UnmaskRefusedError",
        "RoundAbortedError",
        "SecAggConfigError",
    ):
        cls = getattr(errors, name)
        assert issubclass(cls, errors.ProtocolError) and issubclass(cls, errors.CryptoError)
