"""Two runs whose sums differ only by a member that dropped out after ShareKeys are refused by
the surviving sites before they sign the survivor list or send an unmask share (docs/protocol.md
M-204, M-205), even when the coordinator skips its own audit before unmasking (M-124): the
patched coordinator here would unmask run 2 over four sites, whose difference with run 1's sum
over five is site-5's Gram and class vectors. Each survivor refuses in one line naming site-5
(its history records the survivors of run 1, all five, and not the refused set of run 2);
nothing is unmasked and no model is published.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afl.server.store import Store
from tests.e2e import vanishing_client
from tests.e2e.faults.harness import federation, site_state
from tests.e2e.processes import Daemons

pytestmark = pytest.mark.slow

FOUR = ["site-1", "site-2", "site-3", "site-4"]


def test_a_drop_out_after_share_keys_in_a_second_run_is_refused_by_the_survivors(
    tmp_path: Path,
) -> None:
    loop = federation(tmp_path, "mask", sites=5, serve=True, round_settings={"min_participants": 3})
    daemons = Daemons(loop)
    try:
        daemons.start_server(crash_at=("no-unmask-audit", ""))
        daemons.start_clients()
        assert daemons.wait_run("run-1").state == "published", daemons.log_tail()

        daemons.clients["site-5"].terminate()
        daemons.clients["site-5"].wait(timeout=60)
        daemons.start_client("site-5", command=vanishing_client.command("share-keys"))
        daemons.submit("[round]\nupload_timeout_s = 60.0\n", name="site-5 drops out")
        second = daemons.wait_run("run-2")
        assert second.state == "aborted", second
        assert "consistency" in second.reason, second.reason  # no survivor signed the list
        assert daemons.clients["site-5"].wait(timeout=120) == vanishing_client.EXIT_CODE
    finally:
        daemons.stop()
    store = Store(loop.server_config.parent / "state", federation_id=loop.provisioned.federation_id)
    (round_id,) = [r.round_id for r in store.rounds("run-2")]
    reports = {
        site: json.loads((site_state(loop, site) / "reports" / f"{round_id}.json").read_text())
        for site in FOUR
    }

    for site in FOUR:
        report = reports[site]
        assert report["outcome"] == "REFUSED_PLAN", (site, report)
        reason = report["reason"]
        assert "survivors {site-1,site-2,site-3,site-4}" in reason and "dropped: site-5" in reason
        assert "{site-5} by differencing" in reason and "no unmask share" in reason, reason
        rows = json.loads((site_state(loop, site) / "history.json").read_text())["releases"]
        refused = [r for r in rows if r["round_id"] == round_id]
        assert refused and not any("survivors" in r for r in refused)  # not unmasked over them
        earlier = [r for r in rows if r["round_id"] != round_id]
        assert earlier and all(r["survivors"] == sorted(loop.site_ids) for r in earlier), earlier
    assert store.model(round_id) is None
