"""End to end in MASK mode (docs/protocol.md §4.2): afl-server and one afl-client process per site
over loopback gRPC with mutual TLS. The masked federation's W equals the plaintext mode's W on
the same caches; sites killed after ShareKeys or after MaskedInput leave the survivors' exact
result; one drop-out more than the threshold allows aborts the round with a reason and no model;
what the server stores is masked (uncorrelated with the sites' statistics)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.client.daemon.state import DaemonState
from afl.core.aggregation import federated_solve
from afl.core.packing import pack_upper
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

D = 16
CLASSES = ("A", "B", "C")
DATA = SiteData(d=D, classes=len(CLASSES), rows=120, rows_step=20, positive_rate=0.4, seed=11)


def _run(
    root: Path,
    k: int,
    *,
    mask: bool = True,
    vanish: dict[str, str] | None = None,
    timeout_s: float = 6.0,
) -> tuple[LoopbackFederation, LoopbackRun]:
    feats, labels = DATA.draw(k)
    settings: dict[str, Any] = {"gram_scope": "global", "upload_timeout_s": timeout_s}
    if mask:
        settings.update(mask_round_settings(feats))
    loop = prepare_labelled_everywhere(
        root,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        test_rows=20,
        round_settings=settings,
        server_tables={"retention": {"payload_days": 30}},  # inspected after the run
        allow_plaintext=not mask,  # the plaintext baseline: the sites opt in
    )
    commands = {site: vanishing_client.command(stage) for site, stage in (vanish or {}).items()}
    return loop, run_loopback(loop, timeout_s=120, client_commands=commands)


def _stats(loop: LoopbackFederation, sites: list[str]) -> list[LocalStats]:
    return cached_statistics(loop, sites)[0]  # every site labels every class here


def _final_w(run: LoopbackRun, site: str) -> NDArray[np.float64]:
    report = run.final_report(site)
    assert report["outcome"] == "COMPLETED", report
    return np.asarray(np.load(report["model"]["path"]), dtype=np.float64)


def test_masked_w_equals_plaintext_w_and_server_stores_only_masked(tmp_path: Path) -> None:
    loop, run = _run(tmp_path / "mask", 4)
    assert run.client_rcs == dict.fromkeys(loop.site_ids, 0), run.logs
    plain_loop, plain = _run(tmp_path / "plain", 4, mask=False)
    assert plain.client_rcs == dict.fromkeys(plain_loop.site_ids, 0), plain.logs
    w_plain = _final_w(plain, "site-1")
    stats = _stats(loop, list(loop.site_ids))
    w_ref, _ = federated_solve(stats, gamma=1.0, gram_scope="global")
    assert relative_error(w_plain, w_ref) <= 1e-9
    for site in loop.site_ids:
        assert relative_error(_final_w(run, site), w_plain) <= 1e-9
    report = run.final_report("site-1")
    assert report["plan"]["aggregation"] == "AGGREGATION_MODE_MASK"
    slots = {u["slot"] for u in report["uploads"]}
    assert {"gram[all]", "b[A]", "mask/share-keys", "mask/unmask"} <= slots
    # The server's disk holds masked uint64 vectors only: no correlation with the true Gram.
    fed_dir = loop.server_config.parent
    store = Store(fed_dir / "state", federation_id=loop.provisioned.federation_id)
    round_id = report["round_id"]
    uploads = store.uploads(round_id)
    for k, site in enumerate(loop.site_ids):
        stored = np.frombuffer(store.read_payload(uploads[(site, "gram[all]")]), dtype="<u8")
        truth = pack_upper(stats[k].gram)
        assert stored.shape == truth.shape
        as_float = stored.astype(np.float64)
        assert abs(np.corrcoef(as_float, truth)[0, 1]) < 0.35
        # uniform in Z_2^64: the top bit is set about half the time, unlike small encodings
        assert 0.3 < float(np.mean(stored >= np.uint64(1 << 63))) < 0.7


def test_site_killed_after_share_keys_leaves_the_survivors_result(tmp_path: Path) -> None:
    loop, run = _run(tmp_path, 5, vanish={"site-5": "share-keys"})
    assert run.client_rcs["site-5"] == vanishing_client.EXIT_CODE, run.logs
    survivors = ["site-1", "site-2", "site-3", "site-4"]
    assert all(run.client_rcs[s] == 0 for s in survivors), run.logs
    w_ref, _ = federated_solve(_stats(loop, survivors), gamma=1.0, gram_scope="global")
    for site in survivors:
        assert relative_error(_final_w(run, site), w_ref) <= 1e-9
        assert run.final_report(site)["model"]["contributors"] == survivors
        # What the site's whole-history audit counts of the round, whatever the log says.
        state = loop.client_configs[site].parent / "state"
        (recorded,) = DaemonState(state).unmasked()
        assert recorded["round_id"] == run.final_report(site)["round_id"]
        assert recorded["survivors"] == survivors and recorded["releases"]


def test_site_killed_after_masked_input_is_unmasked_from_shares(tmp_path: Path) -> None:
    loop, run = _run(tmp_path, 5, vanish={"site-2": "masked-input"})
    assert run.client_rcs["site-2"] == vanishing_client.EXIT_CODE, run.logs
    rest = ["site-1", "site-3", "site-4", "site-5"]
    assert all(run.client_rcs[s] == 0 for s in rest), run.logs
    # site-2's masked input arrived (it is in U3): its self mask is removed from the others'
    # shares, so the sum includes it.
    w_ref, _ = federated_solve(_stats(loop, list(loop.site_ids)), gamma=1.0, gram_scope="global")
    for site in rest:
        assert relative_error(_final_w(run, site), w_ref) <= 1e-9


def test_one_dropout_beyond_the_threshold_aborts_without_release(tmp_path: Path) -> None:
    # 5 sites, t = 3: three sites vanish after ShareKeys, leaving 2 < t masked inputs.
    vanish = dict.fromkeys(("site-3", "site-4", "site-5"), "share-keys")
    loop, run = _run(tmp_path, 5, vanish=vanish)
    for site in ("site-1", "site-2"):
        assert run.client_rcs[site] == 4, run.logs  # aborted, no replacement
        report = run.final_report(site)
        assert report["outcome"] == "ABORTED"
        assert "fewer than the threshold t=3" in report["reason"]
        assert "nothing released" in report["reason"]
        assert "model" not in report
    store = Store(loop.server_config.parent / "state", federation_id=loop.provisioned.federation_id)
    assert store.model() is None
