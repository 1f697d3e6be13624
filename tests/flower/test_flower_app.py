"""afl's Flower app on Flower's own engines (docs/flower.md): the W every site verifies equals the W
afl's own daemons publish on the same feature caches (≤ 1e-9 relative), and both equal the
in-process solve on those caches.

    mask,      ``flwr run`` on the local simulation engine (flower-superlink --simulation)
    plaintext, the simulation engine started from Python (flwr.simulation.run_simulation; slow:
               the same Ray engine as the first, a second Ray start in the same run of the suite)
    mask,      ``flwr run`` on the deployment engine, one flower-supernode per site (slow: a
               new ClientApp process per message)
    ckks,      ``flwr run`` on the simulation engine with the decryptor as a fourth node (slow):
               within the CKKS bound of the plaintext W (tests/e2e/ckks_tolerance.py)

Needs the Flower extra (``afl[flower]``, installed by ``make venv``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from afl.core.aggregation import federated_solve
from afl.lab.demo.federation import (
    LoopbackFederation,
    LoopbackRun,
    run_loopback,
)
from afl.lab.demo.flower_federation import run_flower
from tests.e2e.loopback import SiteData, cached_statistics
from tests.helpers.flower_nodes import CLASSES, ckks_reference, small_federation
from tests.helpers.numeric import relative_error

pytest.importorskip("flwr", reason="the Flower extra is not installed (make venv installs it)")
pytest.importorskip("ray", reason="Flower's simulation engine needs ray (the Flower extra)")

DATA = SiteData(d=16, classes=len(CLASSES), rows=120, rows_step=20, positive_rate=0.4, seed=7)
K = 3


def _federation(root: Path, mode: str) -> LoopbackFederation:
    return small_federation(
        root, DATA, k=K, mode=mode, upload_timeout_s=300.0, allow_plaintext=mode == "plaintext"
    )


def _w(run: LoopbackRun, site: str) -> NDArray[np.float64]:
    report = run.final_report(site)
    assert report["outcome"] == "COMPLETED", report
    return np.asarray(np.load(report["model"]["path"]), dtype=np.float64)


def _same_w_as_the_daemons(tmp_path: Path, mode: str, engine: str) -> None:
    flower = _federation(tmp_path / "flower", mode)
    run = run_flower(flower, engine=engine, timeout_s=900)
    assert run.server_rc == 0, run.logs
    daemons = _federation(tmp_path / "daemons", mode)
    reference = run_loopback(daemons, timeout_s=300)
    assert reference.client_rcs == dict.fromkeys(daemons.site_ids, 0), reference.logs
    stats, caches = cached_statistics(flower, list(flower.site_ids))
    _, theirs = cached_statistics(daemons, list(daemons.site_ids))
    for mine, other in zip(caches, theirs, strict=True):  # the same feature caches
        assert np.array_equal(mine.features, other.features)
        assert np.array_equal(mine.labels, other.labels)
    w_ref, _ = federated_solve(stats, gamma=1.0, gram_scope="global")
    w_daemons = _w(reference, "site-1")
    assert relative_error(w_daemons, w_ref) <= 1e-9
    for site in flower.site_ids:
        assert relative_error(_w(run, site), w_daemons) <= 1e-9
        report = run.final_report(site)
        assert report["transport"] == "flower"
        assert report["plan"]["aggregation"] == f"AGGREGATION_MODE_{mode.upper()}"
        assert report["model"]["contributors"] == list(flower.site_ids)


def test_flwr_run_on_the_simulation_engine_masks_to_the_daemons_w(tmp_path: Path) -> None:
    _same_w_as_the_daemons(tmp_path, "mask", "simulation")


@pytest.mark.slow
def test_the_simulation_engine_from_python_gives_the_daemons_plaintext_w(tmp_path: Path) -> None:
    _same_w_as_the_daemons(tmp_path, "plaintext", "python")


@pytest.mark.slow
def test_flwr_run_on_the_deployment_engine_masks_to_the_daemons_w(tmp_path: Path) -> None:
    _same_w_as_the_daemons(tmp_path, "mask", "deployment")


@pytest.mark.slow
def test_flwr_run_with_a_decryptor_node_gives_the_ckks_w(tmp_path: Path) -> None:
    fed = _federation(tmp_path, "ckks")
    run = run_flower(fed, engine="simulation", timeout_s=900)
    assert run.server_rc == 0, run.logs
    w_plain, tol = ckks_reference(fed, DATA, k=K)
    for site in fed.site_ids:
        assert run.final_report(site)["plan"]["aggregation"] == "AGGREGATION_MODE_CKKS"
        assert np.all(np.linalg.norm(_w(run, site) - w_plain, axis=0) <= tol)
