"""DP mode with ``aggregation = "mask"`` on the server (docs/protocol.md §5, §7): the fixed-point
bounds, grids and thresholds of the noised statistics (:mod:`afl.server.plan.dp_mask`). Oracles: a
site's actual noisy uploads (:mod:`afl.client.payloads.dp`) for worst-case data (every row at
the clip norm, one direction, every label positive), encoded and summed in Z_2^64 and decoded
back to the exact float64 sum."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.client.payloads.dp import dp_statistics, noisy_values
from afl.core.packing import pack_upper
from afl.core.row_bounds import RowBounds
from afl.crypto.fixedpoint import FixedPointCodec
from afl.ops.provisioning import provision
from afl.proto.v1 import common_pb2 as cpb
from afl.server import toml_text
from afl.server.config import MaskSettings, load_config
from afl.server.modes.mask import MaskMode
from afl.server.plan.dp import DpSettings, apply_dp, calibrate, dp_releases
from afl.server.plan.dp_mask import dp_mask_encodings
from afl.server.plan.release import build_plan

SITES = ["s1", "s2", "s3", "s4", "s5"]
CLASSES = ["a", "b"]
D = 3


def _plan(
    *,
    n_max: int,
    clip: float,
    epsilon: float,
    tolerated: int,
    declared: dict[str, RowBounds] | None = None,
) -> cpb.ReleasePlan:
    """A DP MASK plan with N = ``n_max`` configured, or (``declared``) from the declarations."""
    releases = dp_releases(
        classes=CLASSES,
        participants=SITES,
        coverage={s: CLASSES for s in SITES},
        gram_scope="global",
        d=D,
    )
    dp = DpSettings(epsilon=epsilon, delta=1e-6, clip_norm=clip, tolerated=tolerated)
    calibration = calibrate(releases, dp, participants=SITES, plaintext=False)
    configured = MaskSettings(gram_bound=1.0, vector_bound=1.0, max_samples=n_max)
    strategy = MaskMode(MaskSettings() if declared else configured, identities={})
    plan = build_plan(
        federation_id="f",
        round_id="r1",
        round_number=1,
        participants=SITES,
        gram_scope="global",
        releases=releases,
        options=strategy.plan_options(tuple(SITES), declared=declared),
    )
    apply_dp(plan, calibration)
    strategy.dp_encodings(plan, declared=declared)
    return plan


@settings(max_examples=15, deadline=None)
@given(
    n_max=st.integers(1, 400),
    clip=st.floats(0.1, 10.0),
    epsilon=st.sampled_from([0.5, 4.0, 1e3]),
    tolerated=st.integers(0, 6),
)
def test_worst_case_noisy_uploads_fit_and_sum_exactly(
    n_max: int, clip: float, epsilon: float, tolerated: int
) -> None:
    plan = _plan(n_max=n_max, clip=clip, epsilon=epsilon, tolerated=tolerated)
    h = np.zeros((n_max, D))
    h[:, 0] = clip  # every row at the clip norm, in one direction: |G_00| = N·L²
    y = np.ones((n_max, len(CLASSES)), dtype=np.int64)
    stats = dp_statistics(h, y, labelled=np.ones(len(CLASSES), dtype=bool), clip_norm=clip)
    t = min(tolerated, len(SITES) - 1)
    for release in plan.releases:
        fp = release.encoding.fixed_point
        assert release.noise.assumed_colluders == t
        assert fp.frac_bits >= release.noise.frac_bits + 1
        assert fp.min_survivors == max(3, len(SITES) - t)
        block = {
            cpb.STATISTIC_KIND_GRAM: stats.gram,
            cpb.STATISTIC_KIND_POSITIVE_SUM: stats.positive_sum.T,
            cpb.STATISTIC_KIND_FEATURE_SUM: stats.label_sum.T,
            cpb.STATISTIC_KIND_COUNT: np.stack([stats.positive_count, stats.label_count]),
        }[release.kind]
        uploads = []
        for _ in SITES:
            noisy = noisy_values(release, block)
            flat = pack_upper(noisy) if release.kind == cpb.STATISTIC_KIND_GRAM else noisy.ravel()
            assert float(np.abs(flat).max()) <= fp.bound
            uploads.append(flat)
        codec = FixedPointCodec(bound=fp.bound, frac_bits=fp.frac_bits, max_summands=len(SITES))
        ring = sum((codec.encode(u) for u in uploads), np.zeros(uploads[0].shape, np.uint64))
        assert np.array_equal(codec.decode(ring), np.sum(uploads, axis=0))


def test_a_grid_too_fine_for_the_ring_is_refused() -> None:
    with pytest.raises(ValueError, match="fewer than the noise grid needs"):
        _plan(n_max=2**40, clip=1e3, epsilon=1e5, tolerated=0)


def test_dp_encodings_need_a_dp_plan() -> None:
    plan = _plan(n_max=10, clip=1.0, epsilon=1.0, tolerated=0)
    plan.dp.enabled = False
    with pytest.raises(ValueError, match="need a DP plan"):
        dp_mask_encodings(plan, max_samples=10)


def test_dp_with_mask_takes_n_from_the_config_or_the_sites_declarations(tmp_path: Path) -> None:
    base: dict[str, toml_text.TomlValue] = {
        "classes": CLASSES,
        "feature_dim": D,
        "min_participants": 3,
    }
    fed = provision(tmp_path / "f", sites=SITES, round_settings=base)
    doc = tomllib.loads((fed.server_dir / "server.toml").read_text(encoding="utf-8"))
    doc["round"].update(aggregation="mask")
    doc["round"]["dp"] = {"epsilon": 2.0, "clip_norm": 1.0}
    path = fed.server_dir / "dpmask.toml"
    path.write_text(toml_text.dumps(doc), encoding="utf-8")
    config = load_config(path)  # no mask_* bounds: N comes from the sites' declarations
    assert config.round.mask == MaskSettings()
    rows = {s: 2 ** (i + 3) for i, s in enumerate(SITES)}  # 8 .. 128 rows
    declared = {s: RowBounds(n, 1.0) for s, n in rows.items()}
    plan = _plan(n_max=0, clip=1.0, epsilon=2.0, tolerated=0, declared=declared)
    explicit = _plan(n_max=max(rows.values()), clip=1.0, epsilon=2.0, tolerated=0)
    assert [r.encoding for r in plan.releases] == [r.encoding for r in explicit.releases]
    with pytest.raises(ValueError, match="s5 declared none at enrolment"):
        MaskMode(MaskSettings(), identities={}).dp_encodings(
            plan, declared={s: declared[s] for s in SITES[:4]}
        )
    doc["round"].update(mask_feature_norm=2.0, mask_max_samples=50)
    path.write_text(toml_text.dumps(doc), encoding="utf-8")
    config = load_config(path)
    assert config.round.mask is not None and config.round.mask.max_samples == 50


def test_dp_with_mask_takes_n_from_the_dp_table_before_any_declaration(tmp_path: Path) -> None:
    """docs/protocol.md [M-127]: a site whose policy requires DP declares no row bounds, so a DP
    MASK run takes N from [round.dp] max_samples when mask_max_samples is unset."""
    fed = provision(
        tmp_path / "f",
        sites=SITES,
        round_settings={"classes": CLASSES, "feature_dim": D, "min_participants": 3},
    )
    doc = tomllib.loads((fed.server_dir / "server.toml").read_text(encoding="utf-8"))
    doc["round"].update(aggregation="mask")
    doc["round"]["dp"] = {"epsilon": 2.0, "clip_norm": 1.0, "max_samples": 128}
    path = fed.server_dir / "dpmask.toml"
    path.write_text(toml_text.dumps(doc), encoding="utf-8")
    config = load_config(path)
    assert config.round.mask == MaskSettings()
    plan = _plan(n_max=128, clip=1.0, epsilon=2.0, tolerated=0)
    expected = [cpb.Encoding() for _ in plan.releases]
    for out, r in zip(expected, plan.releases, strict=True):
        out.CopyFrom(r.encoding)
    MaskMode(MaskSettings(), identities={}, settings=config.round).dp_encodings(plan, declared={})
    assert [r.encoding for r in plan.releases] == expected
