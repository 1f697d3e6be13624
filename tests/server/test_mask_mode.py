"""Server side of the MASK mode (docs/protocol.md §4.2, §5): the plan's fixed-point encodings
respect K·B·2^f < 2^63 with the most fractional bits, server and site derive the same protocol
config (digest) from the signed plan, and masked uploads are refused outside the UPLOAD stage."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.client.daemon_stats import PayloadError
from afl.client.mode_mask import MaskStrategy as ClientMask
from afl.client.mode_mask_wire import round_config_from_plan as site_config
from afl.crypto.signatures import public_key_to_raw
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import MaskSettings
from afl.server.errors import WrongStageError
from afl.server.mask_wire import round_config_from_plan as server_config
from afl.server.mode_mask import MaskStrategy
from afl.server.plan import build_plan, round1_releases

SITES = ("site-1", "site-2", "site-3", "site-4")


def _strategy(gram: float = 5.0e4, vector: float = 20.0) -> MaskStrategy:
    keys = {s: public_key_to_raw(Ed25519PrivateKey.generate().public_key()) for s in SITES}
    return MaskStrategy(MaskSettings(gram_bound=gram, vector_bound=vector), identities=keys)


def _plan(strategy: MaskStrategy, d: int = 6) -> cpb.ReleasePlan:
    releases = round1_releases(
        classes=("A", "B"),
        participants=SITES,
        coverage={},
        gram_scope="global",
        d=d,
        need_global_gram=False,
    )
    return build_plan(
        federation_id="fed",
        round_id="r1-x",
        round_number=1,
        participants=SITES,
        gram_scope="global",
        releases=releases,
        **strategy.plan_options(SITES),
    )


@settings(max_examples=30, deadline=None)
@given(gram=st.floats(1.0, 1.0e9), vector=st.floats(1.0e-3, 1.0e3))
def test_encodings_use_the_most_fractional_bits_below_the_ring_half(
    gram: float, vector: float
) -> None:
    plan = _plan(_strategy(gram, vector))
    assert plan.aggregation == cpb.AGGREGATION_MODE_MASK
    assert plan.mask_threshold == 3  # a majority of 4
    for release in plan.releases:
        fp = release.encoding.fixed_point
        assert release.encoding.dtype == cpb.DTYPE_UINT64_LE
        k = len(release.member_site_ids)
        assert k * fp.bound * 2.0**fp.frac_bits < 2.0**63
        assert k * fp.bound * 2.0 ** (fp.frac_bits + 1) >= 2.0**63 * (1 - 1e-12)
        expected = gram if release.kind == cpb.STATISTIC_KIND_GRAM else vector
        assert fp.bound == expected


def test_server_and_site_derive_the_same_protocol_config() -> None:
    plan = _plan(_strategy())
    assert server_config(plan).digest() == site_config(plan).digest()
    assert server_config(plan).t == 3


def test_masked_upload_only_in_the_upload_stage() -> None:
    strategy = _strategy()
    plan = _plan(strategy)
    row = SimpleNamespace(
        round_id="r1-x", stage=pb.ROUND_STAGE_ADVERTISE_KEYS, plan=plan.SerializeToString()
    )
    view = SimpleNamespace(round_id="r1-x", row=row)
    strategy._start(view)
    with pytest.raises(WrongStageError, match="UPLOAD stage"):
        strategy.admit_upload(view, "site-1")
    row.stage = pb.ROUND_STAGE_UPLOAD
    strategy.admit_upload(view, "site-1")  # accepted now


def test_site_refuses_values_beyond_the_declared_bound() -> None:
    plan = _plan(_strategy(vector=1.0))
    b_release = next(r for r in plan.releases if r.kind == cpb.STATISTIC_KIND_CLASS_VECTOR)
    import numpy as np

    with pytest.raises(PayloadError, match="exceeds the plan's declared bound"):
        ClientMask().encode(b_release, np.full(6, 2.0))
    assert len(ClientMask().encode(b_release, np.full(6, 0.5))) == 48
