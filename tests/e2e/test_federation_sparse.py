"""End to end with a sparse masking graph (SecAgg+, docs/protocol.md §4.2 "Sparse graph"):
afl-server and many sites hosted per process by ``afl-client run-many`` (each site with its own
kit and mutual-TLS channel) over loopback gRPC. The masked W equals the W of an independent
plaintext solve of the sites' summed statistics; up to D = n - t drop-outs leave the survivors'
exact result; one more aborts the round with nothing released. K = 256 runs behind ``slow``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.linalg
from numpy.typing import NDArray

from afl.core.stats import LocalStats
from afl.lab.demo.federation import (
    LoopbackFederation,
    LoopbackRun,
    mask_round_settings,
    prepare_labelled_everywhere,
    run_loopback,
)
from afl.server.store import Store
from tests.e2e import vanishing_client
from tests.e2e.loopback import SiteData, cached_statistics
from tests.helpers.numeric import relative_error

CLASSES = ("A", "B", "C")
DATA = SiteData(d=8, classes=len(CLASSES), rows=40, rows_step=2, positive_rate=0.4, seed=5)
GAMMA = 1.0


def _run(
    root: Path,
    k: int,
    *,
    dropout_fraction: float = 0.05,
    vanish: dict[str, str] | None = None,
    stage_timeout_s: float = 120.0,
    sites_per_process: int = 12,
) -> tuple[LoopbackFederation, LoopbackRun]:
    feats, labels = DATA.draw(k)
    settings: dict[str, Any] = {
        **mask_round_settings(feats),
        "gram_scope": "global",
        "mask_graph": "sparse",
        "mask_dropout_fraction": dropout_fraction,
        "enrol_timeout_s": 600.0,
        "upload_timeout_s": stage_timeout_s,
    }
    loop = prepare_labelled_everywhere(
        root,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        test_rows=10,
        round_settings=settings,
        client_settings={"poll_interval_s": 0.2, "max_poll_interval_s": 2.0},
    )
    commands = {site: vanishing_client.command(stage) for site, stage in (vanish or {}).items()}
    run = run_loopback(
        loop, timeout_s=1800, client_commands=commands, sites_per_process=sites_per_process
    )
    return loop, run


def _plaintext_w(stats: list[LocalStats]) -> NDArray[np.float64]:
    """The oracle: W = (Σ G_k + γI)⁻¹ Σ B_k, summed here in float64 and solved by scipy."""
    gram = sum((s.gram for s in stats), np.zeros_like(stats[0].gram))
    b = sum((s.b for s in stats), np.zeros_like(stats[0].b))
    gram[np.diag_indices_from(gram)] += GAMMA
    return np.asarray(scipy.linalg.solve(gram, b, assume_a="pos"), dtype=np.float64)


def _final_w(run: LoopbackRun, site: str) -> NDArray[np.float64]:
    report = run.final_report(site)
    assert report["outcome"] == "COMPLETED", report
    return np.asarray(np.load(report["model"]["path"]), dtype=np.float64)


def _check_sparse_round(loop: LoopbackFederation, run: LoopbackRun, k: int) -> None:
    assert run.client_rcs == dict.fromkeys(loop.site_ids, 0), run.logs
    w_plain = _plaintext_w(cached_statistics(loop, list(loop.site_ids))[0])
    for site in loop.site_ids:
        assert relative_error(_final_w(run, site), w_plain) <= 1e-9
    graph = run.final_report(loop.site_ids[0])["plan"]["mask_graph"]
    assert 2 <= int(graph["degree"]) < k - 1  # a sparse graph, not the full one
    assert int(graph["share_threshold"]) <= int(graph["degree"])


def test_sparse_round_of_24_hosted_sites_equals_the_plaintext_w(tmp_path: Path) -> None:
    loop, run = _run(tmp_path, 24)
    _check_sparse_round(loop, run, 24)


def test_sparse_round_survives_the_stated_drop_outs(tmp_path: Path) -> None:
    # 20 sites, drop-out fraction 0.1: D = 2, t = 18; one vanishes after ShareKeys (its input
    # is left out), one after its masked upload (its input is in: its self mask is removed).
    vanish = {"site-20": "share-keys", "site-7": "masked-input"}
    loop, run = _run(tmp_path, 20, dropout_fraction=0.1, vanish=vanish, stage_timeout_s=40.0)
    plan = run.final_report("site-1")["plan"]
    assert int(plan["mask_graph"]["dropouts"]) == 2
    for site in vanish:
        assert run.client_rcs[site] == vanishing_client.EXIT_CODE, run.logs
    rest = [s for s in loop.site_ids if s not in vanish]
    assert all(run.client_rcs[s] == 0 for s in rest), run.logs
    inputs = [s for s in loop.site_ids if s != "site-20"]
    w_ref = _plaintext_w(cached_statistics(loop, inputs)[0])
    for site in rest:
        assert relative_error(_final_w(run, site), w_ref) <= 1e-9
        assert sorted(run.final_report(site)["model"]["contributors"]) == sorted(inputs)


def test_one_drop_out_past_the_bound_aborts_with_nothing_released(tmp_path: Path) -> None:
    # D = 2: three sites vanish after ShareKeys, leaving 17 < t = 18 masked inputs.
    vanish = dict.fromkeys(("site-3", "site-9", "site-20"), "share-keys")
    loop, run = _run(tmp_path, 20, dropout_fraction=0.1, vanish=vanish, stage_timeout_s=40.0)
    for site in (s for s in loop.site_ids if s not in vanish):
        assert run.client_rcs[site] == 4, run.logs  # aborted, no replacement
        report = run.final_report(site)
        assert report["outcome"] == "ABORTED"
        assert "fewer than the threshold t=18" in report["reason"]
        assert "nothing released" in report["reason"]
        assert "model" not in report
    store = Store(loop.server_config.parent / "state", federation_id=loop.provisioned.federation_id)
    assert store.model() is None


@pytest.mark.slow
def test_sparse_round_of_256_hosted_sites_equals_the_plaintext_w(tmp_path: Path) -> None:
    loop, run = _run(tmp_path, 256, sites_per_process=64, stage_timeout_s=1200.0)
    _check_sparse_round(loop, run, 256)
