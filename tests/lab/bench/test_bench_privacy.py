"""`afl bench privacy` on a small federation: curves per mechanism variant, scope cost, table,
plot."""

from __future__ import annotations

import math

import pytest

from afl.lab.bench.privacy import parse_variant, plot, run_privacy_bench, table
from tests.lab.synthetic import small_federation


def test_privacy_bench_curves_and_plot(tmp_path):
    fed = small_federation(4)
    variants = ("default:image:1", "previous:image:1")
    bench = run_privacy_bench(
        fed,
        missing=(1, 3),
        epsilons=(1.0, 1e6, math.inf),
        clip_norm=50.0,
        variants=variants,
    )
    assert set(bench["curves"]) == {
        f"{v} missing-{m} ({scope})"
        for v in variants
        for m in (1, 3)
        for scope in ("per-class", "global")
    }
    for label, curve in bench["curves"].items():
        assert curve["epsilon"] == [1.0, 1e6, "inf"]
        # No noise (ε = inf) with a clip larger than every row equals the non-private solve up to
        # the pooled normalisation (and, for the default mechanism, label clipping), which
        # coincides with per-site normalisation for AUC ranking only approximately: check the
        # ranking metric is close, and huge ε approaches it.
        assert abs(curve["auc"][2] - curve["no_dp"]["auc"]) < 0.05, label
        assert abs(curve["auc"][1] - curve["auc"][2]) < 0.02, label
    assert set(bench["global_minus_per_class"]) == {"missing-1", "missing-3"}
    text = table(bench)
    assert text.count("\n") == len(bench["curves"]) + 1 and "default:image:1 missing-1" in text
    png = tmp_path / "u.png"
    plot(bench, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_variants_are_parsed_and_patient_level_needs_patient_ids():
    assert parse_variant("previous:patient:2") == ("previous", "patient", 2, 0)
    assert parse_variant("default:image:1:64") == ("default", "image", 1, 64)
    for bad in (
        "default:patient",
        "other:image:1",
        "default:row:1",
        "default:image:0",
        "a:b:1:2:3",
    ):
        with pytest.raises(ValueError, match="variant"):
            parse_variant(bad)
    with pytest.raises(ValueError, match="patient ids"):
        run_privacy_bench(
            small_federation(4), missing=(1,), epsilons=(1.0,), variants=("default:patient:1",)
        )
