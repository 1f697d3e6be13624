"""End to end over loopback gRPC with mutual TLS: afl-server and one afl-client process per site.
The federated W must equal the in-process solve on the same caches (≤ 1e-9 relative), a site whose
policy refuses the plan says why, and `afl demo` runs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from afl.client.config import load_client_config
from afl.client.daemon.loop import ClientDaemon
from afl.client.daemon.transport import DaemonError
from afl.client.modes.base import PlaintextMode
from afl.core.aggregation import class_b_sums, federated_solve
from afl.core.refinement import RefinementParams, pseudo_label_projection, solve_round2
from afl.lab.demo.federation import LoopbackFederation, LoopbackRun, prepare_loopback, run_loopback
from afl.proto.v1 import common_pb2 as cpb
from tests.e2e.loopback import SiteData, cached_statistics
from tests.helpers.numeric import relative_error

D = 32
CLASSES = ("A", "B", "C")
PARAMS = RefinementParams(tau=0.5, alpha=0.5, delta_pos=2, delta_neg=2)
DATA = SiteData(d=D, classes=len(CLASSES), rows=250, rows_step=30, positive_rate=0.35, seed=7)


def _federation(
    root: Path, active: NDArray[np.bool_], **kw: object
) -> tuple[LoopbackFederation, LoopbackRun]:
    feats, labels = DATA.draw(active.shape[0])
    loop = prepare_loopback(
        root,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        active=active,
        test_features=feats[0][:50],
        test_labels=labels[0][:50],
        allow_plaintext=True,  # a plaintext federation: every site opts in
        **kw,  # type: ignore[arg-type]
    )
    return loop, run_loopback(loop, timeout_s=120)


def _weights(run: LoopbackRun, site: str, round_number: int) -> NDArray[np.float64]:
    (report,) = [r for r in run.reports[site].values() if r["round_number"] == round_number]
    assert report["outcome"] == "COMPLETED", report
    return np.asarray(np.load(report["model"]["path"]), dtype=np.float64)


def test_two_round_federation_matches_in_process_solve(tmp_path: Path) -> None:
    active = np.array([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=bool)
    settings = {"gram_scope": "global", "rounds": 2, "tau": PARAMS.tau,
                "delta_pos": PARAMS.delta_pos, "delta_neg": PARAMS.delta_neg}  # fmt: skip
    loop, run = _federation(tmp_path, active, round_settings=settings)
    assert run.client_rcs == dict.fromkeys(loop.site_ids, 0), run.logs
    stats, caches = cached_statistics(loop, list(loop.site_ids))
    w1_ref, plan = federated_solve(stats, gamma=1.0, gram_scope="global")
    pseudo = [
        pseudo_label_projection(c.features, weights=w1_ref, missing=~active[k], params=PARAMS)
        for k, c in enumerate(caches)
    ]
    assert any(p.contributes.any() for p in pseudo)  # round 2 is not a no-op
    w2_ref = solve_round2(
        gram_total=np.sum([s.gram for s in stats], axis=0),
        b_real=class_b_sums(plan, [s.b for s in stats]),
        b_pseudo=np.sum([p.b for p in pseudo], axis=0),
        alpha=PARAMS.alpha,
        gamma=1.0,
    )
    for site in loop.site_ids:
        assert relative_error(_weights(run, site, 1), w1_ref) <= 1e-9
        assert relative_error(_weights(run, site, 2), w2_ref) <= 1e-9
    report = run.final_report("site-1")
    d_packed = D * (D + 1) // 2
    # Round 2 uploads one b_pseudo[c] per class; round 1 the packed Gram and one b[c] per class.
    (r1,) = [r for r in run.reports["site-1"].values() if r["round_number"] == 1]
    assert r1["bytes_sent"] == 8 * (d_packed + len(CLASSES) * D)
    assert report["bytes_sent"] == 8 * len(CLASSES) * D
    assert {u["slot"] for u in r1["uploads"]} == {"gram[all]", "b[A]", "b[B]", "b[C]"}
    assert r1["plan"]["accepted"] and r1["model"]["signature_valid"]


def test_exposed_site_refuses_and_the_rest_complete_per_class(tmp_path: Path) -> None:
    # Class C is labelled by site-1..3 only: gram[all] - gram{1,2,3} would expose site-4's Gram.
    active = np.array([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=bool)
    settings = {"gram_scope": "per-class", "operator_override": True,
                "override_reason": "e2e test of a site's refusal"}  # fmt: skip
    loop, run = _federation(tmp_path, active, round_settings=settings)
    assert run.client_rcs["site-4"] == 3, run.logs
    refusal = run.final_report("site-4")
    assert refusal["outcome"] == "REFUSED_PLAN"
    assert "expose this site's gram by differencing" in refusal["reason"]
    assert not refusal["plan"]["accepted"] and "model" not in refusal
    assert refusal["bytes_sent"] == 0
    # The coordinator aborts that plan and re-plans with the three remaining sites.
    remaining = ["site-1", "site-2", "site-3"]
    assert all(run.client_rcs[s] == 0 for s in remaining), run.logs
    stats, _ = cached_statistics(loop, remaining)
    w_ref, _ = federated_solve(stats, gamma=1.0, gram_scope="per-class")
    for site in remaining:
        # A site may or may not have seen the aborted round before the replacement opened.
        outcomes = sorted(r["outcome"] for r in run.reports[site].values())
        assert outcomes in (["COMPLETED"], ["ABORTED", "COMPLETED"])
        final = run.final_report(site)
        assert final["plan"]["participants"] == remaining
        assert relative_error(np.load(final["model"]["path"]), w_ref) <= 1e-9


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    keep = tmp_path / "demo"
    cmd = [sys.executable, "-m", "afl.lab.cli", "demo", "--d", "32", "--quiet", "--keep", str(keep)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "signature verified by every site" in out
    assert "macro" in out and "bytes sent" in out
    assert out.count("COMPLETED") == 8
    assert (keep / "federation" / "ca.pem").exists()


class _CrashAfterFirstUpload(PlaintextMode):
    """Uploads the first slot, then dies like a killed process would."""

    def exchange(self, session, payloads, *, already_complete=()):
        super().exchange(session, payloads[:1], already_complete=already_complete)
        raise DaemonError("simulated crash after the first upload")


def test_restarted_client_resumes_from_its_state(tmp_path: Path) -> None:
    active = np.ones((3, len(CLASSES)), dtype=bool)
    feats, labels = DATA.draw(3)
    loop = prepare_loopback(
        tmp_path, classes=CLASSES, site_features=feats, site_labels=labels, active=active,
        test_features=feats[0][:20], test_labels=labels[0][:20], allow_plaintext=True,
    )  # fmt: skip
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "afl.server.daemon.main", "--config", str(loop.server_config)]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        configs = {s: load_client_config(p) for s, p in loop.client_configs.items()}
        codes: dict[str, int] = {}

        def other(site: str) -> None:
            codes[site] = ClientDaemon(configs[site]).run()

        threads = [threading.Thread(target=other, args=(s,)) for s in ("site-2", "site-3")]
        for t in threads:
            t.start()
        crashing = ClientDaemon(
            configs["site-1"], modes={cpb.AGGREGATION_MODE_PLAINTEXT: _CrashAfterFirstUpload()}
        )
        with pytest.raises(DaemonError, match="simulated crash"):
            crashing.run()
        assert not crashing.stats_from_state
        restarted = ClientDaemon(configs["site-1"])
        restarted.prepare()
        assert restarted.stats_from_state  # nothing recomputed from the cache
        assert restarted.run() == 0
        for t in threads:
            t.join(timeout=120)
        assert codes == {"site-2": 0, "site-3": 0}
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    reports = sorted(
        (configs["site-1"].state_dir / "reports").glob("*.json"), key=lambda p: p.stat().st_mtime
    )
    final = json.loads(reports[-1].read_text())
    assert final["outcome"] == "COMPLETED"
    skipped = [u["slot"] for u in final["uploads"] if u["already_complete"]]
    assert skipped == ["gram[all]"]  # the upload done before the crash is not sent again
    stats, _ = cached_statistics(loop, list(loop.site_ids))
    w_ref, _ = federated_solve(stats, gamma=1.0, gram_scope="global")
    assert relative_error(np.load(final["model"]["path"]), w_ref) <= 1e-9
