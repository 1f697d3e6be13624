"""A coordinator that corrupts the history the sites' whole-history audit reads (docs/protocol.md
§11a, M-206), through the real daemons: the coordinator is patched at run time
(tests/adversarial/malicious_server.py), the sites are unmodified and serve several runs.

* ``hide-release``: run 1 over {1..5} is unmasked, then aborted with no `release` statement in
  the federation log; run 2 over {1..4} would difference to site-5's statistics. Each site that
  helped unmask run 1 recorded it (``state_dir/unmasked.json``) before it signed the survivors,
  counts it whatever the log says, warns that the log lacks it, and refuses run 2 naming site-5.
* ``hide-release``, separate views: seven sites; run 1 over {5,6,7} is unmasked and hidden, run 2
  over all seven is published, run 3 over {1,2,3} would give site-4's statistics as
  run 2 - run 1 - run 3. Sites 1..3 never took part in run 1 and the coordinator's books hold no
  release of it; they refuse run 3 naming site-4, because sites 5..7 logged their signed
  `opening` statements of run 1 before they sent an unmask share (M-232).
* ``hide-release-ckks``, separate views in ``ckks``: the same seven-site runs; run 1's round is
  decrypted and hidden. Sites 1..3 refuse run 3 naming site-4, because sites 5..7 logged their
  signed openings of run 1 over its participants before their first ciphertext left (M-232).
* ``reuse-round-id``: run 2's round takes the id of run 1's published round (over {1,2,3}), now
  over {1,2,3,4}, and the coordinator skips its own history audit (its own audit, and a site's
  own history, leave the plan's round id out: the two rounds would look like one release). The
  sites of run 1 see a round they completed offered again and stop, naming it (M-142); site-4,
  which joined after run 1, finds a release of that round id in the log and refuses the plan (a
  round id is planned once, M-206), with site-5 (a witness only) completing the log quorum.

* ``fake-release``: runs over {1,2,5} and {3,4} are published, and the coordinator logs a
  release of a made-up round over site-5 alone; the run over {1,2,3,4} would give site-5's
  statistics as G(125) - G(1234) + G(34). Judged with the made-up release as known before, the
  plan would add nothing; the sites count as known before only releases that every survivor
  signed an opening of (M-233), and refuse it naming site-5 and the two real rounds.

* ``unwitness-fake-release``: as ``fake-release``, but run 1 over {1,2,5} is unmasked over
  all three while the coordinator refuses to log site-5's opening, so run 1 is real and not
  witnessed; run 2 over {1,2,3,4} is witnessed, and run 3 over {3,4} gives site-5 as
  G(125) - G(1234) + G(34). Sites 3 and 4 know before only run 2, which run 3 adds nothing
  to, and the made-up release covers the whole history's exposure; but run 1 is among what
  some site signed (sites 1 and 2 opened it), and run 3 adds site-5's exposure to that part,
  so they refuse it (M-233).
* ``drop-at-upload``: eight sites; runs over {5,6,7} and {1,2,3,4,6,7} are published; run 3
  over {1,2,3,4,8} passes every whole-history audit as planned, then the coordinator refuses
  site-8's masked input: unmasked over {1,2,3,4} it would give site-5's statistics as
  G(567) - G(123467) + G(1234). The survivors audit the sums as they would be unmasked with
  the log's whole history again before they sign the survivors (M-206), and refuse.
* ``hide-release-ckks`` with a colluding participant: eight sites, min cohort 2; run 1 over
  {5,6,7,8} is decrypted and hidden, and site-8 (tests/adversarial/unopened_client.py) uploaded
  without logging its opening. Had the audits counted run 1 over its openers {5,6,7}, run 3
  over {1,2,3} would look like G(4) + G(8) after run 2 over all eight, yet the real sums give
  site-4 alone; they count it over every participant its openings state, and refuse run 3.
* ``skip-review-ckks``: the seven-site ckks runs; for run 3 the coordinator reports that each
  participant already accepted the plan, which would skip their plan review (log check,
  whole-history audit); a site takes part only under a plan its own upload register shows it
  accepted, so each refuses.

Nothing of a refused run is uploaded or unmasked: the coordinator's loot holds the earlier runs'
sums only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afl.crypto.transparency.statements import decode_statement, release_sha256
from afl.lab.demo.federation import LoopbackFederation
from afl.server.store import Store
from tests.adversarial import malicious_server, unopened_client
from tests.e2e.faults.harness import federation
from tests.e2e.loopback import cached_statistics
from tests.e2e.processes import Daemons
from tests.e2e.test_whole_history_audit import _participants, _refusals, _store, separate_views

SITES = tuple(f"site-{i}" for i in range(1, 6))


def _statements(loop: LoopbackFederation, store: Store) -> list[tuple[str, dict[str, Any]]]:
    fed = loop.provisioned.federation_id
    return [
        decode_statement(entry, federation=fed)
        for _, _, entry, _ in store.log_entries(0, store.log_size())
    ]


def _loot(path: Path) -> dict[str, list[float]]:
    found: dict[str, list[float]] = json.loads(path.read_text()) if path.exists() else {}
    return found


def _hidden(
    loop: LoopbackFederation,
    loot: Path,
    *,
    opened_by: tuple[str, ...],
    survivors: tuple[str, ...] = (),
) -> tuple[Store, Any, dict[str, list[float]], list[tuple[str, dict[str, Any]]]]:
    """The store, run-1's round, the loot and the log's statements, once checked that the attack
    happened (the coordinator unmasked run 1's sums and the log has no release statement of it)
    and that each of ``opened_by`` logged its signed opening of the round over them before it
    sent an unmask share (M-232), which every site's audit counts whatever the coordinator
    states."""
    store = _store(loop)
    (hidden,) = store.rounds("run-1")
    taken = _loot(loot)
    assert f"run-1/{hidden.round_id}/gram[all]" in taken, sorted(taken)
    statements = _statements(loop, store)
    released = [f["round_id"] for kind, f in statements if kind == "release"]
    assert hidden.round_id not in released, statements
    openings = [
        f for kind, f in statements if kind == "opening" and f["round_id"] == hidden.round_id
    ]
    assert sorted(str(f["site"]) for f in openings) == sorted(opened_by), statements
    stated = sorted(survivors or opened_by)
    bodies = {release_sha256(f).hex(): f for kind, f in statements if kind == "opened-release"}
    assert all(bodies[str(f["release_sha256"])]["survivors"] == stated for f in openings), openings
    return store, hidden, taken, statements


def test_a_round_unmasked_and_left_out_of_the_log_still_stops_the_run_that_differences_it(
    tmp_path: Path,
) -> None:
    loop = federation(tmp_path, "mask", sites=5, serve=True)
    loot = tmp_path / "loot.json"
    daemons = Daemons(loop)
    try:
        daemons.start_server(command=malicious_server.command("hide-release", loot))
        daemons.start_clients()
        first = daemons.wait_run("run-1")
        assert first.state == "aborted", daemons.log_tail()
        daemons.submit(_participants(*SITES[:4]), name="without site-5")
        second = daemons.wait_run("run-2")
        assert second.state == "aborted", daemons.log_tail()
    finally:
        daemons.stop()

    store, hidden, taken, statements = _hidden(loop, loot, opened_by=SITES)
    assert all(name.startswith(f"run-1/{hidden.round_id}/") for name in taken), sorted(taken)
    assert ("round-aborted", hidden.round_id) in [(k, f.get("round_id")) for k, f in statements]

    for site in SITES:  # each member recorded, before it signed the survivors, what it unmasked
        state = loop.client_configs[site].parent / "state"
        (record,) = json.loads((state / "unmasked.json").read_text())["rounds"]
        assert record["round_id"] == hidden.round_id and record["survivors"] == list(SITES)

    refused = _refusals("run-2", store)
    assert refused and set(refused) <= set(SITES[:4]), (refused, daemons.log_tail())
    for site, reason in refused.items():
        assert "would expose" in reason and "site-5" in reason and "M-206" in reason, reason
        assert f"{hidden.round_id}/gram[all]" in reason, reason
        assert "keep those sites in the run" in reason and "DP" in reason, reason  # M-208
        log = (daemons.logs / f"{site}.log").read_text()
        assert f"holds no release statement of round(s) {hidden.round_id}" in log
    assert "site-5" in second.reason and "M-206" in second.reason, second.reason
    assert sum(len(store.uploads(r.round_id)) for r in store.rounds("run-2")) == 0


def _hidden_then_three(
    tmp_path: Path,
    mode: str,
    attack: str,
    *,
    sites: int = 7,
    policy: dict[str, Any] | None = None,
    commands: dict[str, tuple[str, ...]] | None = None,
    until_logged: str = "",
) -> tuple[LoopbackFederation, Path, Daemons, Any]:
    """The separate-views runs of ``attack``: run 1 over sites 5 and up (hidden), run 2 over every
    site (published), run 3 over sites 1..3; the federation, the loot, the (stopped) daemons
    and run 3's outcome (with ``until_logged``: None, the daemons are stopped once sites 1..3
    each logged that text, since the coordinator would wait for them until its deadline)."""
    everyone = tuple(f"site-{i}" for i in range(1, sites + 1))
    loop = federation(
        tmp_path,
        mode,
        sites=sites,
        serve=True,
        round_settings={"min_participants": 3, "participants": list(everyone[4:])},
        policy=policy,
    )
    loot = tmp_path / "loot.json"
    daemons = Daemons(loop)
    try:
        daemons.start_server(command=malicious_server.command(attack, loot))
        daemons.start_clients(commands=commands)
        assert daemons.wait_run("run-1").state == "aborted", daemons.log_tail()
        daemons.submit(_participants(*everyone), name="everyone")
        second = daemons.wait_run("run-2")
        assert second.state == "published", (second, daemons.log_tail())
        daemons.submit(_participants(*everyone[:3]), name="three of the first four")
        if until_logged:
            daemons.wait_logged(until_logged, sites=everyone[:3])
            third = None
        else:
            third = daemons.wait_run("run-3")
    finally:
        daemons.stop()
    return loop, loot, daemons, third


@pytest.mark.parametrize("mode", ["mask", "ckks"])
def test_a_hidden_release_reaches_the_audit_of_sites_that_never_took_part_in_it(
    tmp_path: Path, mode: str
) -> None:
    sites = tuple(f"site-{i}" for i in range(1, 8))
    first, last = sites[4:], sites[:3]
    attack = "hide-release" if mode == "mask" else "hide-release-ckks"
    loop, loot, daemons, third = _hidden_then_three(tmp_path, mode, attack)
    assert third.state == "aborted", daemons.log_tail()

    store, hidden, taken, _ = _hidden(loop, loot, opened_by=first)

    refused = _refusals("run-3", store)
    assert refused and set(refused) <= set(last), (refused, daemons.log_tail())
    for site, reason in refused.items():
        assert "would expose" in reason and "site-4" in reason and "M-206" in reason, reason
        assert f"{hidden.round_id}/gram[all]" in reason, reason
        log = (daemons.logs / f"{site}.log").read_text()
        assert f"holds no release statement of round(s) {hidden.round_id}" in log, log[-2000:]
    assert sum(len(store.uploads(r.round_id)) for r in store.rounds("run-3")) == 0
    assert not [name for name in taken if name.startswith("run-3/")], sorted(taken)


def test_a_round_id_reused_after_its_release_is_refused_and_never_unmasked(
    tmp_path: Path,
) -> None:
    first_sites, later = SITES[:3], "site-4"
    loop = federation(
        tmp_path,
        "mask",
        sites=5,
        serve=True,
        round_settings={"min_participants": 3, "participants": list(first_sites)},
        policy={"witness_quorum": 2},  # site-4 and site-5 are a quorum once 1..3 stopped
    )
    loot = tmp_path / "loot.json"
    daemons = Daemons(loop)
    try:
        daemons.start_server(command=malicious_server.command("reuse-round-id", loot))
        for site in (*first_sites, "site-5"):
            daemons.start_client(site)
        first = daemons.wait_run("run-1")
        assert first.state == "published", daemons.log_tail()
        # Each site of run 1 completed it (verified its model) before the coordinator takes the
        # round's id for run 2 (and moves the model away in its database).
        reports = daemons.wait_reports(first.model_round_id, sites=first_sites)
        assert {r["outcome"] for r in reports.values()} == {"COMPLETED"}, reports
        daemons.start_client(later)  # joins after run 1: it never saw that round
        daemons.submit(_participants(*first_sites, later), name="with site-4")
        second = daemons.wait_run("run-2")
        assert second.state == "aborted", daemons.log_tail()
        # Each site of run 1 stopped on its own (no timing: it stops at its first status
        # answer that offers the round again, whatever stage run 2 is at by then).
        stopped = {site: daemons.clients[site].wait(timeout=300) for site in first_sites}
    finally:
        daemons.stop()

    store = _store(loop)
    (published,) = store.rounds("run-1")  # renamed in the coordinator's own database
    (reused,) = store.rounds("run-2")
    assert published.round_id == f"{reused.round_id}-old", (published, reused)
    statements = _statements(loop, store)
    plans = [f for kind, f in statements if kind == "plan" and f["round_id"] == reused.round_id]
    releases = [f for kind, f in statements if kind == "release"]
    assert len(plans) == 2, statements  # one round id, two signed plans in the log
    assert [(f["round_id"], f["run_id"]) for f in releases] == [(reused.round_id, "run-1")]

    # The sites of run 1 stop when the round they completed is offered again (M-142) ...
    for site, code in stopped.items():
        assert code not in (0, None), (site, code)
        log = (daemons.logs / f"{site}.log").read_text()
        assert "the coordinator offers a round id it used before" in log, log[-2000:]
        assert f"round {reused.round_id} in run-2, and this site completed round" in log, log
        assert "in run-1: a round id names one round, ever" in log, log[-2000:]
    # ... and site-4, which never took part in it, refuses it: the log released that round id.
    decisions = store.decisions(reused.round_id)
    assert set(decisions) == {later}, (decisions, daemons.log_tail())
    accepted, reason = decisions[later]
    assert not accepted
    assert f"the federation log already holds a release of round {reused.round_id}" in reason
    assert "a round id is planned once" in reason and "M-206" in reason, reason
    assert reason in second.reason, second.reason
    assert store.uploads(reused.round_id) == {}
    taken = _loot(loot)
    assert taken and all(name.startswith("run-1/") for name in taken), sorted(taken)


def _separate_runs(
    tmp_path: Path, attack: str, *, second: tuple[str, ...], third: tuple[str, ...]
) -> tuple[LoopbackFederation, Path, Daemons, Any]:
    """The separate-views federation under ``attack``: run 1 over {1,2,5} and run 2 over
    ``second`` published, then run 3 over ``third``; the federation, the loot, the (stopped)
    daemons and run 3's outcome."""
    loop = separate_views(tmp_path)
    loot = tmp_path / "loot.json"
    daemons = Daemons(loop)
    try:
        daemons.start_server(command=malicious_server.command(attack, loot))
        daemons.start_clients()
        # (with a survivor that could not sign, a masked round is still unmasked)
        assert daemons.wait_run("run-1").state == "published", daemons.log_tail()
        daemons.submit(_participants(*second), name="second")
        assert daemons.wait_run("run-2").state == "published", daemons.log_tail()
        daemons.submit(_participants(*third), name="third")
        outcome = daemons.wait_run("run-3")
    finally:
        daemons.stop()
    return loop, loot, daemons, outcome


def test_a_made_up_release_does_not_let_a_plan_expose_the_site_it_names(tmp_path: Path) -> None:
    v = "site-5"
    loop, loot, daemons, third = _separate_runs(
        tmp_path, "fake-release", second=("site-3", "site-4"), third=SITES[:4]
    )
    assert third.state == "aborted", daemons.log_tail()

    store = _store(loop)
    first, second = (store.rounds(r)[0].round_id for r in ("run-1", "run-2"))
    statements = _statements(loop, store)
    made_up = [f for kind, f in statements if kind == "release" and f["run_id"] == "run-0"]
    assert [(f["round_id"], f["survivors"]) for f in made_up] == [(f"{first}-made-up", [v])]
    assert not [r for r in store.rounds() if r.round_id == f"{first}-made-up"]
    refused = _refusals("run-3", store)
    assert refused and set(refused) <= set(SITES[:4]), (refused, daemons.log_tail())
    for reason in refused.values():
        assert "would expose" in reason and v in reason and "M-206" in reason, reason
        assert f"{first}/gram[all]" in reason and f"{second}/gram[all]" in reason, reason
    assert sum(len(store.uploads(r.round_id)) for r in store.rounds("run-3")) == 0
    assert not [name for name in _loot(loot) if name.startswith("run-3/")], sorted(_loot(loot))


def test_a_made_up_release_does_not_hide_a_round_one_survivor_could_not_open(
    tmp_path: Path,
) -> None:
    """``unwitness-fake-release``: run 1 over {1,2,5} is unmasked over all three although the
    coordinator refused to log site-5's opening (sites 1 and 2 signed the consistency check,
    t of them suffice); run 2 over {1,2,3,4} is published and witnessed; the coordinator logs
    a made-up release over site-5 alone. Run 3 over {3,4} gives site-5's statistics as
    G(125) - G(1234) + G(34), from real releases only: sites 3 and 4 refuse it, because the
    openings of sites 1 and 2 put run 1 among what some site signed (M-233)."""
    v = "site-5"
    loop, loot, _, third = _separate_runs(
        tmp_path, "unwitness-fake-release", second=SITES[:4], third=("site-3", "site-4")
    )

    store = _store(loop)
    (first,) = store.rounds("run-1")
    statements = _statements(loop, store)
    opened = {f["site"] for kind, f in statements if kind == "opening"}
    released = [
        f for kind, f in statements if kind == "release" and f["round_id"] == first.round_id
    ]
    assert released and released[0]["survivors"] == ["site-1", "site-2", v]  # the sum holds site-5
    assert v not in opened  # ... and site-5 never opened it: the release is not witnessed
    assert {"site-1", "site-2", "site-3", "site-4"} <= opened
    taken = _loot(loot)
    assert third.state == "aborted", sorted(taken)  # published: the coordinator holds site-5's sums
    refused = _refusals("run-3", store)
    assert refused and set(refused) <= {"site-3", "site-4"}, refused
    for reason in refused.values():
        assert "would expose" in reason and v in reason, reason
    assert sum(len(store.uploads(r.round_id)) for r in store.rounds("run-3")) == 0


def test_a_made_up_drop_out_does_not_difference_a_site_through_the_log_s_history(
    tmp_path: Path,
) -> None:
    """``drop-at-upload``, eight sites, min cohort 2: run 1 over {5,6,7} and run 2 over
    {1,2,3,4,6,7} are published; run 3 over {1,2,3,4,8} adds nothing to the log's history as
    planned (every participant's whole-history audit passes it), but the coordinator refuses
    site-8's masked input, and unmasked over {1,2,3,4} it gives site-5's statistics as
    G(567) - G(123467) + G(1234). Sites 1..4 never shared a run with site-5; their survivor
    check reads only their own history (runs 2 and 3), where {1,2,3,4} exposes the group
    {6,7}, which min cohort 2 allows. Nothing of run 3 may be unmasked."""
    sites = tuple(f"site-{i}" for i in range(1, 9))
    loop = federation(
        tmp_path,
        "mask",
        sites=8,
        serve=True,
        round_settings={"min_participants": 3, "participants": ["site-5", "site-6", "site-7"]},
        policy={"min_cohort": 2, "witness_quorum": 2},
    )
    loot = tmp_path / "loot.json"
    daemons = Daemons(loop)
    try:
        daemons.start_server(command=malicious_server.command("drop-at-upload", loot))
        daemons.start_clients()
        assert daemons.wait_run("run-1").state == "published", daemons.log_tail()
        daemons.submit(_participants(*sites[:4], "site-6", "site-7"), name="1-4, 6, 7")
        assert daemons.wait_run("run-2").state == "published", daemons.log_tail()
        daemons.submit(_participants(*sites[:4], "site-8"), name="1-4, 8")
        # Each survivor refuses at its survivors check; the coordinator would wait for their
        # signatures until the stage's deadline, so the test stops once all four refused.
        logs = daemons.wait_logged("refuses to unmask over the survivors", sites=sites[:4])
    finally:
        daemons.stop()

    for site, log in logs.items():
        refusal = next(line for line in log.splitlines() if "refuses to unmask" in line)
        assert "site-5" in refusal and "M-206" in refusal, (site, refusal)
    store = _store(loop)
    assert not _refusals("run-3", store)  # the plan adds nothing to the history as planned
    taken = _loot(loot)
    assert not [name for name in taken if name.startswith("run-3/")], sorted(taken)


def _assert_gram_of(site: str, loop: LoopbackFederation, taken: dict[str, list[float]]) -> None:
    """The loot's Gram sums of runs 1..3 (one round each) give ``site``'s own Gram as
    G(run 2) - G(run 1) - G(run 3): checked against the site's cached statistics."""
    gram = {k.split("/")[0]: np.array(v) for k, v in taken.items() if k.endswith("/gram[all]")}
    leaked = gram["run-2"] - gram["run-1"] - gram["run-3"]
    (own,), _ = cached_statistics(loop, [site])
    d = own.gram.shape[0]
    full = own.gram.ravel() if leaked.size == d * d else own.gram[np.triu_indices(d)]
    assert np.allclose(leaked, full, rtol=1e-6, atol=1e-6 * np.abs(full).max())


def test_a_ckks_participant_that_uploads_without_opening_is_left_out_of_the_audit(
    tmp_path: Path,
) -> None:
    """Review of 861eb95: ``hide-release-ckks`` with one colluding participant, eight sites,
    min cohort 2. Run 1 over {5,6,7,8} is decrypted and hidden; site-8 (the colluder,
    tests/adversarial/unopened_client.py) uploaded without logging its opening. Run 2 over
    all eight is published. Had the audits counted run 1 over its openers {5,6,7}, run 3 over
    {1,2,3} would look like G(1..8) - G(567) - G(123) = G(4) + G(8), a group min cohort 2
    allows, while the real sums give site-4 alone: G(1..8) - G(5678) - G(123). Every audit
    counts run 1 over every participant its openings state, so sites 1..3 refuse run 3 naming
    site-4."""
    sites = tuple(f"site-{i}" for i in range(1, 9))
    first = sites[4:]
    loop, loot, daemons, third = _hidden_then_three(
        tmp_path,
        "ckks",
        "hide-release-ckks",
        sites=8,
        policy={"min_cohort": 2},
        commands={"site-8": unopened_client.command()},
    )

    store, _, taken, _ = _hidden(loop, loot, opened_by=first[:3], survivors=first)
    if third.state == "published":  # what the attack gave: site-4's Gram, from the real sums
        _assert_gram_of("site-4", loop, taken)
    assert third.state == "aborted", (third, daemons.log_tail())
    refused = _refusals("run-3", store)
    assert refused and set(refused) <= set(sites[:3]), (refused, daemons.log_tail())
    for reason in refused.values():
        assert "would expose" in reason and "site-4" in reason, reason
    assert not [name for name in taken if name.startswith("run-3/")], sorted(taken)


def test_a_coordinator_that_says_a_site_accepted_does_not_skip_its_whole_history_audit(
    tmp_path: Path,
) -> None:
    """Review (older than M-232): ``skip-review-ckks``, the seven-site runs of the hidden
    release test in ``ckks``. For run 3 over {1,2,3}, which every one of them refuses when it
    reviews the plan, the coordinator reports that each already accepted (a site restarted
    after it accepted is told the same): the daemon then skips its plan review, the log check
    and the whole-history audit (``reviewing`` in ClientDaemon.run_round), checks the plan
    against its own history only, and uploads. Run 3 must not be decrypted."""
    first = tuple(f"site-{i}" for i in range(5, 8))
    refusal = "holds no record of taking part under it"
    loop, loot, _, _ = _hidden_then_three(
        tmp_path, "ckks", "skip-review-ckks", until_logged=refusal
    )
    _, _, taken, _ = _hidden(loop, loot, opened_by=first)
    assert not [name for name in taken if name.startswith("run-3/")], sorted(taken)
    store = _store(loop)
    assert sum(len(store.uploads(r.round_id)) for r in store.rounds("run-3")) == 0
