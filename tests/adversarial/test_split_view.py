"""A coordinator that shows two groups of sites two different federation logs (a split view,
docs/protocol.md §11a, M-192, M-193) is caught by the sites as witnesses, through the real
daemons: no quorum cosigns either view, the round does not proceed, and the sites shown both
views keep both signed checkpoints as evidence and stop with one line naming them."""

from __future__ import annotations

import json
from pathlib import Path

from afl.crypto.transparency.statements import decode_statement
from afl.lab.demo.federation import mask_round_settings, run_loopback
from tests.adversarial import malicious_server
from tests.adversarial.test_malicious_coordinator import DATA, _prepare, _shorten_wait, _store

K = 4


def test_a_split_view_is_caught_by_the_witnesses_and_the_round_does_not_proceed(
    tmp_path: Path,
) -> None:
    feats, _ = DATA.draw(K)
    settings = {**mask_round_settings(feats), "min_participants": K, "upload_timeout_s": 40.0}
    # The stage timeout bounds both the honest sites' wait for a quorum (none comes) and the time
    # the split group has to reach the plan and see both views: generous for a loaded machine.
    loop = _prepare(tmp_path, K, settings)
    _shorten_wait(loop, 20.0)
    command = malicious_server.command("split-view", tmp_path / "loot.json")
    run = run_loopback(loop, timeout_s=240, server_command=command)
    logs = {site: run.logs[site].read_text() for site in loop.site_ids}
    honest = [s for s in loop.site_ids if s not in malicious_server.SPLIT_GROUP]
    for site in malicious_server.SPLIT_GROUP:
        assert run.client_rcs[site] == 1, logs[site][-3000:]
        evidence = sorted((loop.client_configs[site].parent / "state" / "log-evidence").glob(
            "split-view-*.json"))  # fmt: skip
        assert len(evidence) == 1, logs[site][-3000:]
        doc = json.loads(evidence[0].read_text())
        cosigned, offered = doc["cosigned"], doc["offered"]
        assert cosigned["root"] != offered["root"]
        # The one line names both checkpoints (sizes and root prefixes) and the evidence file.
        line = next(ln for ln in logs[site].splitlines() if "two inconsistent checkpoints" in ln)
        for cp in (cosigned, offered):
            assert f"size {cp['size']} root {cp['root'][:16]}" in line, line
        assert str(evidence[0].name) in line
    for site in honest:  # no quorum ever cosigned the plan's checkpoint: nothing sent
        assert run.client_rcs[site] in (3, 4), logs[site][-3000:]
        for report in run.reports[site].values():
            assert report["bytes_sent"] == 0 and "model" not in report
    store = _store(loop)
    try:
        assert store.model() is None
        assert not [row for r in store.rounds() for row in store.uploads(r.round_id).values()]
        fed = loop.provisioned.federation_id
        kinds = [
            decode_statement(entry, federation=fed)[0]
            for _, _, entry, _ in store.log_entries(0, store.log_size())
        ]
        assert "plan" in kinds and "release" not in kinds
        # The true checkpoint holding the plan has the honest group's cosignatures only.
        last = store.log_checkpoint()
        assert last is not None
        witnesses = {w for w, _, _ in store.log_cosignatures(last[0])}
        assert witnesses <= set(honest)
    finally:
        store.close()
