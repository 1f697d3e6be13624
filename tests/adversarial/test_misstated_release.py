"""A coordinator whose federation log misstates a published round's survivors (one site fewer
than the sums hold: every other site's whole-history audit would count that site's statistics
as never released) is caught by the round's members (docs/protocol.md §11a, M-230), through the
real daemons: each keeps the statement and what it signed as evidence and stops in one line."""

from __future__ import annotations

import json
from pathlib import Path

from afl.lab.demo.federation import mask_round_settings, run_loopback
from tests.adversarial import malicious_server
from tests.adversarial.test_malicious_coordinator import DATA, _prepare

K = 3


def test_a_misstated_release_statement_stops_every_member_with_evidence(tmp_path: Path) -> None:
    feats, _ = DATA.draw(K)
    settings = {**mask_round_settings(feats), "min_participants": K}
    loop = _prepare(tmp_path, K, settings)
    command = malicious_server.command("misstate-release", tmp_path / "loot.json")
    run = run_loopback(loop, timeout_s=240, server_command=command)
    hidden = sorted(loop.site_ids)[-1]  # the survivor the statement leaves out
    for site in loop.site_ids:
        log = run.logs[site].read_text()
        assert run.client_rcs[site] == 1, log[-3000:]
        (evidence,) = (loop.client_configs[site].parent / "state" / "log-evidence").glob(
            "release-*.json"
        )
        doc = json.loads(evidence.read_text())
        assert doc["survivors_signed"] == sorted(loop.site_ids)
        assert "this site signed" in doc["reason"] and hidden in doc["reason"]
        line = next(ln for ln in log.splitlines() if "names survivors" in ln)
        assert evidence.name in line and hidden in line
        report = run.final_report(site)
        assert report["outcome"] == "FAILED" and "names survivors" in report["reason"]
