"""Every site audits a plan with the whole released history of the federation log (docs/protocol.md
§11a, M-206..M-208), through the real daemons, against a coordinator that skips its own history
audit (tests/e2e/faulty_server.py ``no-history-audit``):

* attack 2, separate views, as small as it goes (min_cohort 2): runs over {1,2,5}, then {3,4},
  then {1,2,3,4}: site-5's Gram is G(125) − G(1234) + G(34), although sites 3 and 4 never shared
  a run with it and every site's own history passes. The third run is refused before anything is sent,
  naming site-5 and the two earlier rounds (the audit does not depend on which participant runs
  it: sites 3 and 4 decide exactly as 1 and 2, tests/client/policy/test_log_history.py);
* attack 1, a site that left: then a run over {1,2} differences with {1,2,5} to site-5: refused.

Nothing of either refused run reaches the coordinator, and the log records no release of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from afl.crypto.transparency.statements import decode_statement
from afl.server.store import Store
from tests.e2e.faults.harness import federation
from tests.e2e.processes import Daemons

V = "site-5"


def _participants(*sites: str) -> str:
    """A run over ``sites`` that ends when one refuses (no re-plan with the others)."""
    names = ", ".join(f'"{s}"' for s in sites)
    return f"[round]\nparticipants = [{names}]\nmin_participants = {len(sites)}\n"


def _store(loop: Any) -> Store:
    return Store(loop.server_config.parent / "state", federation_id=loop.provisioned.federation_id)


def _refusals(run_id: str, store: Store) -> dict[str, str]:
    """The sites' signed plan refusals of ``run_id``'s rounds, by site."""
    out: dict[str, str] = {}
    for row in store.rounds(run_id):
        for site, (accepted, reason) in store.decisions(row.round_id).items():
            if not accepted:
                out[site] = reason
    return out


def separate_views(tmp_path: Path) -> Any:
    """Five masked sites that serve several runs, the first over {1, 2, 5}, at min_cohort 2."""
    return federation(
        tmp_path,
        "mask",
        sites=5,
        # Serving sites stay for the later runs (a non-serving site exits a second after its
        # run: whether it saw the next run then depended on how fast the machine was).
        serve=True,
        round_settings={"min_participants": 2, "participants": ["site-1", "site-2", V]},
        # Runs of two sites: they are their own witness quorum (idle sites witness only when a
        # round event wakes them).
        policy={"min_cohort": 2, "witness_quorum": 2},
    )


def test_sites_refuse_plans_that_the_log_s_history_differences_to_another_site(
    tmp_path: Path,
) -> None:
    loop = separate_views(tmp_path)
    daemons = Daemons(loop)
    try:
        daemons.start_server(crash_at=("no-history-audit", "-"))
        daemons.start_clients()
        assert daemons.wait_run("run-1").state == "published", daemons.log_tail()
        daemons.submit(_participants("site-3", "site-4"), name="C, D")
        assert daemons.wait_run("run-2").state == "published", daemons.log_tail()

        # Attack 2: sites 3 and 4 never shared a run with site-5.
        daemons.submit(_participants("site-1", "site-2", "site-3", "site-4"), name="A, B, C, D")
        third = daemons.wait_run("run-3")
        assert third.state == "aborted", third

        # Attack 1: site-5 left; re-train without it.
        daemons.submit(_participants("site-1", "site-2"), name="without site-5")
        fourth = daemons.wait_run("run-4")
        assert fourth.state == "aborted", fourth
    finally:
        daemons.stop()

    store = _store(loop)
    first, second = (store.rounds(r)[0].round_id for r in ("run-1", "run-2"))
    for run, info, sites in (
        ("run-3", third, {"site-1", "site-2", "site-3", "site-4"}),
        ("run-4", fourth, {"site-1", "site-2"}),
    ):
        refused = _refusals(run, store)
        assert refused and set(refused) <= sites, (run, refused, daemons.log_tail())
        for reason in (*refused.values(), info.reason):
            assert "would expose" in reason and V in reason and "M-206" in reason, reason
            assert f"{first}/gram[all]" in reason, reason
            assert "keep those sites in the run" in reason and "DP" in reason, reason
        if run == "run-3":  # the separate view: both earlier runs are named
            assert all(f"{second}/gram[all]" in r for r in refused.values()), refused

    # Nothing of runs 3 and 4 was uploaded, and the log released only runs 1 and 2.
    for run_id in ("run-3", "run-4"):
        assert sum(len(store.uploads(r.round_id)) for r in store.rounds(run_id)) == 0
    fed = loop.provisioned.federation_id
    released = {
        str(fields["run_id"]): fields
        for kind, fields in (
            decode_statement(entry, federation=fed)
            for _, _, entry, _ in store.log_entries(0, store.log_size())
        )
        if kind == "release"
    }
    assert sorted(released) == ["run-1", "run-2"], released
    # M-209: each release statement names the round's releases over their planned members.
    for run_id, members in (("run-1", ["site-1", "site-2", V]), ("run-2", ["site-3", "site-4"])):
        logged: dict[str, Any] = released[run_id]
        assert logged["survivors"] == members
        grams = [r for r in logged["releases"] if r["kind"] == "STATISTIC_KIND_GRAM"]
        assert [sorted(r["members"]) for r in grams] == [members], logged
