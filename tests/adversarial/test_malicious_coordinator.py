"""A malicious coordinator against honest sites and an honest decryptor (docs/protocol.md §2):
each attack runs through the real daemons over loopback mutual TLS, with the coordinator patched at
run time (tests/adversarial/malicious_server.py) or misconfigured, and the sites and decryptor
unmodified. Each test asserts that the honest parties refuse (exit codes, report reasons,
the decryptor's outcomes) and that nothing single-site is released: the decryptor decrypts no
forged sum, the coordinator's loot holds no release of one site, and no model is published.

1. ``forward-single``: a site's ciphertext presented as the sum of three (the tag check refuses).
2. ``forged-tags``: the same with tags the coordinator sealed "from" the other members (the
   decryptor counts only tags the members signed).
3. ``lower-threshold``: survivor threshold t_R = 1 in the signed plan, two members' masked inputs
   dropped (each member's policy refuses t_R below its min cohort before sending anything).
4. downgrade: the coordinator of a MASK federation switches to ``plaintext`` (each site's policy
   allows mask and ckks only).
5. ``swap-keys``: in a federation provisioned the production way, the operator who runs the
   coordinator and holds the CA swaps site-1's advertised keys for its own (the other sites verify
   every advert with the identity key pinned in their kit, which only site-1 holds).
6. ``evaluate-unverified``: a run's evaluation round names a crafted model no round published
   (each site evaluates only a model it verified itself).
7. ``isolate-site``: a run's evaluation plan adds a histogram over all participants but one (the
   isolated site's policy finds its statistics determined by differencing and refuses).
8. ``weaken-graph``: a sparse masking graph of degree 2 and neighbourhood threshold 2 in the
   signed plan (each site recomputes its failure probability with its own colluder bound and
   refuses before sending anything).
9. ``refuse-opening`` (ckks, mask): the coordinator logs no site's `opening` statement, which
   would let it hide the round's release from every other site's audit (M-232): in ckks no site
   sends a statistic, so nothing is decrypted; in mask no consistency signature is kept (each
   carries its site's opening), so no site sends an unmask share and nothing is unmasked.
10. ``drop-opening`` (mask): the coordinator answers the openings as logged, appends none and
   keeps the consistency signatures: each site waits at the unmask stage for its opening in a
   quorum-cosigned checkpoint, finds none, and sends no unmask share; nothing is unmasked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afl.lab.demo.federation import (
    LoopbackFederation,
    LoopbackRun,
    ckks_round_settings,
    mask_round_settings,
    prepare_loopback,
    run_loopback,
)
from afl.server.store import Store
from tests.adversarial import malicious_server
from tests.e2e.loopback import SiteData

D = 8
CLASSES = ("A", "B", "C")
DATA = SiteData(d=D, classes=len(CLASSES), rows=60, rows_step=10, positive_rate=0.4, seed=5)
EXIT_REFUSED, EXIT_ABORTED = 3, 4


def _prepare(root: Path, k: int, settings: dict[str, Any], **kw: Any) -> LoopbackFederation:
    feats, labels = DATA.draw(k)
    active = kw.pop("active", np.ones((k, len(CLASSES)), dtype=bool))
    return prepare_loopback(
        root,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        active=active,
        test_features=feats[0][:10],
        test_labels=labels[0][:10],
        round_settings={"upload_timeout_s": 60.0, "min_participants": 3, **settings},
        **kw,
    )


def _store(loop: LoopbackFederation) -> Store:
    return Store(loop.server_config.parent / "state", federation_id=loop.provisioned.federation_id)


def _loot(path: Path) -> dict[str, list[float]]:
    found: dict[str, list[float]] = json.loads(path.read_text()) if path.exists() else {}
    return found


def _no_model_and_no_uploads_kept(loop: LoopbackFederation, *, uploads: bool) -> None:
    store = _store(loop)
    try:
        assert store.model() is None
        stored = [row for r in store.rounds() for row in store.uploads(r.round_id).values()]
        assert bool(stored) == uploads
    finally:
        store.close()


def _decryptor_outcomes(loop: LoopbackFederation) -> dict[str, str]:
    assert loop.decryptor_config is not None
    record = loop.decryptor_config.parent / "state" / "ckks" / "decryptions.jsonl"
    lines = record.read_text().splitlines() if record.exists() else []
    return {json.loads(line)["release"]: json.loads(line)["status"] for line in lines}


def _ckks_attack(tmp_path: Path, attack: str) -> tuple[LoopbackFederation, LoopbackRun, Path]:
    feats, _ = DATA.draw(3)
    loop = _prepare(tmp_path, 3, ckks_round_settings(feats), decryptor=True)
    loot = tmp_path / "loot.json"
    command = malicious_server.command(attack, loot)
    return loop, run_loopback(loop, timeout_s=240, server_command=command), loot


def _assert_ckks_attack_refused(loop: LoopbackFederation, run: LoopbackRun, loot: Path) -> None:
    assert run.client_rcs == dict.fromkeys(loop.site_ids, EXIT_ABORTED), run.logs
    outcomes = _decryptor_outcomes(loop)
    assert outcomes[malicious_server.CKKS_TARGET] == "DECRYPTION_STATUS_REFUSED_TAG_MISMATCH"
    assert malicious_server.CKKS_TARGET not in _loot(loot)  # nothing single-site decrypted
    for site in loop.site_ids:
        report = run.final_report(site)
        assert report["outcome"] == "ABORTED" and "model" not in report
        assert "the decryptor refused release" in report["reason"]
    _no_model_and_no_uploads_kept(loop, uploads=True)


def test_forwarded_single_ciphertext_is_refused_by_the_decryptor(tmp_path: Path) -> None:
    loop, run, loot = _ckks_attack(tmp_path, "forward-single")
    _assert_ckks_attack_refused(loop, run, loot)
    # What the coordinator did get decrypted are honest sums over all three sites (the round
    # aborts at the refusal, so jobs after it in the list may never be served).
    assert set(_loot(loot)) <= {"b[A]", "b[B]", "b[C]"}


def test_tags_forged_by_the_coordinator_are_refused(tmp_path: Path) -> None:
    loop, run, loot = _ckks_attack(tmp_path, "forged-tags")
    _assert_ckks_attack_refused(loop, run, loot)
    # Without site-2's and site-3's own tags no release of theirs is decrypted at all.
    assert _loot(loot) == {}
    assert set(_decryptor_outcomes(loop).values()) == {"DECRYPTION_STATUS_REFUSED_TAG_MISMATCH"}
    log = run.logs["decryptor"].read_text()
    assert re.search(r"tags from site-2 refused: .*signature", log), log[-2000:]


def test_a_ckks_round_whose_openings_are_not_logged_sends_no_statistic(tmp_path: Path) -> None:
    loop, run, loot = _ckks_attack(tmp_path, "refuse-opening")
    assert set(run.client_rcs.values()) <= {EXIT_ABORTED, 1}, run.logs
    assert 0 not in run.client_rcs.values(), run.client_rcs
    for site in loop.site_ids:
        log = run.logs[site].read_text()
        assert re.search(
            r"the coordinator did not log this site's opening of round \S+ \(.*logs no "
            r"openings.*\): no statistic is sent",
            log,
        ), log[-3000:]
    assert _loot(loot) == {}  # nothing was decrypted
    _no_model_and_no_uploads_kept(loop, uploads=False)


@pytest.mark.parametrize("attack", ["refuse-opening", "drop-opening"])
def test_a_masked_round_whose_openings_are_not_logged_unmasks_nothing(
    tmp_path: Path, attack: str
) -> None:
    feats, _ = DATA.draw(3)
    loop = _prepare(tmp_path, 3, {**mask_round_settings(feats), "upload_timeout_s": 10.0})
    loot = tmp_path / "loot.json"
    command = malicious_server.command(attack, loot)
    run = run_loopback(loop, timeout_s=240, server_command=command)
    assert 0 not in run.client_rcs.values(), run.client_rcs
    why = (
        "ConsistencyCheck: INVALID_ARGUMENT: this coordinator logs no openings"
        if attack == "refuse-opening"
        else "this site's opening of round .* is not in a federation-log checkpoint cosigned by"
        " a quorum .*: no unmask share is sent"
    )
    for site in loop.site_ids:
        log = run.logs[site].read_text()
        assert re.search(why, log), log[-3000:]
        for report in run.reports[site].values():
            assert "model" not in report
            assert not report["timings_s"].get("mask_unmask"), report  # no unmask share left
    assert _loot(loot) == {}  # nothing was unmasked
    _no_model_and_no_uploads_kept(loop, uploads=True)
    store = _store(loop)
    try:
        kinds = [kind for _, kind, _, _ in store.log_entries(0, store.log_size())]
        assert "opening" not in kinds and "release" not in kinds, kinds
    finally:
        store.close()


def test_a_ckks_round_the_log_records_as_aborted_is_not_decrypted_afterwards(
    tmp_path: Path,
) -> None:
    """M-235: the coordinator logs the round's abort (every site's audit would count its sums
    as never released, so a re-plan without one of its sites would pass) and hands the sums to
    the decryptor all the same. The decryptor logs its `decrypting` statement, finds the abort
    before it in the log and refuses: nothing is decrypted, the round ends without a model."""
    loop, run, loot = _ckks_attack(tmp_path, "abort-then-decrypt")
    assert _loot(loot) == {}, sorted(_loot(loot))  # nothing was decrypted
    assert _decryptor_outcomes(loop) == {}  # no job reached the key (a refusal, reported)
    assert loop.decryptor_config is not None
    state = loop.decryptor_config.parent / "state" / "ckks"
    assert not (state / "decrypted.json").exists()  # the secret key touched nothing
    for site in loop.site_ids:
        report = run.final_report(site)
        assert report["outcome"] == "ABORTED" and "model" not in report, report
        assert "aborted before this decryptor's decrypting statement" in report["reason"], report
    store = _store(loop)
    try:
        assert store.model() is None
        kinds = [kind for _, kind, _, _ in store.log_entries(0, store.log_size())]
        assert kinds.index("round-aborted") < kinds.index("decrypting"), kinds
    finally:
        store.close()


def _shorten_wait(loop: LoopbackFederation, seconds: float) -> None:
    """Sites that never see a round (it was refused and aborted before their next poll, and no
    replacement comes) give up after ``seconds`` instead of waiting for another round."""
    for path in loop.client_configs.values():
        text = path.read_text()
        path.write_text(re.sub(r"^max_wait_s = .*$", f"max_wait_s = {seconds}", text, flags=re.M))


def test_lowered_survivor_threshold_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    # Per-class scope: b[A] is summed over the labellers of A (site-1..3), b[B], b[C] over 3..5.
    active = np.array([[1, 0, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [0, 1, 1]], dtype=bool)
    feats, _ = DATA.draw(5)
    settings = {"gram_scope": "per-class", **mask_round_settings(feats)}
    loop = _prepare(tmp_path, 5, settings, active=active)
    _shorten_wait(loop, 20.0)
    loot = tmp_path / "loot.json"
    command = malicious_server.command("lower-threshold", loot)
    run = run_loopback(loop, timeout_s=240, server_command=command)
    refusal = (
        "release b[A] would be unmasked with 1 surviving member(s), fewer than this site "
        "accepts (3: min cohort, or the DP noise's members)"
    )
    # The first refusal aborts the round; the coordinator re-plans with the others (again with
    # t_R = 1, or with releases below the min cohort), so each site ends refusing (3), aborted
    # while it decided (4), or without having seen a round (1). None of them sent anything.
    assert set(run.client_rcs.values()) <= {EXIT_REFUSED, EXIT_ABORTED, 1}, run.logs
    reasons = [
        r["reason"]
        for site in loop.site_ids
        for r in run.reports[site].values()
        if r["outcome"] == "REFUSED_PLAN"
    ]
    assert refusal in reasons, run.logs  # the members of b[A] refuse the lowered threshold
    assert all(r == refusal or "< min cohort 3" in r for r in reasons), reasons
    for site in loop.site_ids:
        for report in run.reports[site].values():
            assert report["bytes_sent"] == 0 and "model" not in report
    assert _loot(loot) == {}
    _no_model_and_no_uploads_kept(loop, uploads=False)


def test_downgrade_to_plaintext_is_refused_by_every_site(tmp_path: Path) -> None:
    feats, _ = DATA.draw(3)
    # A MASK federation's kits. min_participants = 1: after each refusal the coordinator
    # re-plans (still plaintext) with the sites left, so every site gets to decide.
    loop = _prepare(tmp_path, 3, {**mask_round_settings(feats), "min_participants": 1})
    text = loop.server_config.read_text()
    loop.server_config.write_text(text.replace('aggregation = "mask"', 'aggregation = "plaintext"'))
    run = run_loopback(loop, timeout_s=240)
    assert run.client_rcs == dict.fromkeys(loop.site_ids, EXIT_REFUSED), run.logs
    for site in loop.site_ids:
        report = run.final_report(site)
        assert report["outcome"] == "REFUSED_PLAN" and report["bytes_sent"] == 0
        assert report["reason"] == (
            "aggregation mode 'plaintext' is not allowed by this site's policy "
            "(allowed_aggregation = ['mask', 'ckks'])"
        )
    _no_model_and_no_uploads_kept(loop, uploads=False)


def test_keys_swapped_by_the_operator_are_refused(tmp_path: Path) -> None:
    feats, _ = DATA.draw(3)
    loop = _prepare(tmp_path, 3, mask_round_settings(feats), production=True)
    _shorten_wait(loop, 20.0)
    loot = tmp_path / "loot.json"
    run = run_loopback(
        loop, timeout_s=240, server_command=malicious_server.command("swap-keys", loot)
    )
    # Every private key stayed in its own kit: the operator's folder holds public material only.
    operator = loop.provisioned.root / "operator"
    assert (operator / "ca" / "ca.key").is_file()
    assert [p.name for p in operator.rglob("*.key")] == ["ca.key"]
    assert all((kit / "identity.key").is_file() for kit in loop.provisioned.site_dirs.values())
    for site in malicious_server.OTHERS:
        reasons = [r["reason"] for r in run.reports[site].values()]
        assert any("advert of 'site-1' does not verify" in r for r in reasons), run.logs
    assert run.client_rcs[malicious_server.VICTIM] != 0, run.logs  # its round never completes
    for site in loop.site_ids:
        assert all("model" not in r for r in run.reports[site].values())
    assert _loot(loot) == {}  # nothing was unmasked
    store = _store(loop)
    try:
        assert store.model() is None
        masked = [
            key for r in store.rounds() for key in store.uploads(r.round_id) if key[0] != "site-1"
        ]
        assert masked == []  # the other sites sent no masked input under the swapped keys
    finally:
        store.close()


def _evaluation_attack(
    tmp_path: Path, attack: str, k: int, **settings: Any
) -> tuple[LoopbackFederation, LoopbackRun, Path]:
    """A MASK run with ``evaluate = true`` (bounds from the sites' declarations) whose
    evaluation round the patched coordinator attacks; the training round is honest."""
    loop = _prepare(tmp_path, k, {"aggregation": "mask", "evaluate": True, **settings})
    loot = tmp_path / "loot.json"
    command = malicious_server.command(attack, loot)
    return loop, run_loopback(loop, timeout_s=240, server_command=command), loot


def _refusal_reasons(
    loop: LoopbackFederation, run: LoopbackRun, *, undecided: Collection[str] = ()
) -> list[tuple[str, str]]:
    """(site, reason) of every refused evaluation plan, once every site but ``undecided`` took
    part in evaluation rounds and none sent anything or received a result."""
    refusals = []
    for site, rounds in _evaluation_reports(loop, run).items():
        assert rounds or site in undecided, site
        for report in rounds:
            assert report["bytes_sent"] == 0, (site, report)
            assert "files" not in report.get("evaluation", {}), (site, report)  # no result
            assert report["outcome"] in ("REFUSED_PLAN", "ABORTED"), (site, report)
            if report["outcome"] == "REFUSED_PLAN":
                refusals.append((site, report["reason"]))
    return refusals


def _evaluation_reports(loop: LoopbackFederation, run: LoopbackRun) -> dict[str, list[Any]]:
    """Each site's reports of evaluation rounds (round ids e<n>-…), after a completed model."""
    out = {}
    for site in loop.site_ids:
        reports = run.reports[site]
        assert any(r["outcome"] == "COMPLETED" and "model" in r for r in reports.values()), site
        out[site] = [r for rid, r in reports.items() if rid.startswith("e")]
    return out


def _nothing_evaluated(loop: LoopbackFederation, loot: Path) -> None:
    assert not [name for name in _loot(loot) if name.startswith("eval")]  # no sum unmasked
    store = _store(loop)
    try:
        assert all(store.evaluation(r.round_id) is None for r in store.rounds())
        (run,) = store.runs()
        assert run.state == "published" and run.reason.startswith("evaluation aborted"), run
    finally:
        store.close()


def test_an_evaluation_of_a_model_the_sites_did_not_verify_is_refused(tmp_path: Path) -> None:
    # min_participants = 1: after each refusal the coordinator re-plans with the others, so
    # every site gets to decide on the crafted model.
    # (On a loaded machine two sites may refuse before the third decides: the run then ends,
    # since an evaluation over one site would expose it, and that site, which completed the
    # training round and was offered nothing else to decide, exits 0.)
    loop, run, loot = _evaluation_attack(tmp_path, "evaluate-unverified", 3, min_participants=1)
    assert set(run.client_rcs.values()) <= {EXIT_REFUSED, EXIT_ABORTED, 0}, run.logs
    undecided = [site for site, rc in run.client_rcs.items() if rc == 0]
    assert len(undecided) <= 1, run.logs
    refusals = _refusal_reasons(loop, run, undecided=undecided)
    assert len(refusals) >= 2, refusals
    assert all("which this site has not verified" in reason for _, reason in refusals), refusals
    _nothing_evaluated(loop, loot)


def test_an_evaluation_plan_isolating_a_site_is_refused_by_that_site(tmp_path: Path) -> None:
    """The victim refuses its own exposure; its peers refuse the plan on its behalf (M-99), so
    whichever honest site decides first, the plan gets no upload; re-plans (over the sites left,
    isolating the first of them) end the same way."""
    loop, run, loot = _evaluation_attack(tmp_path, "isolate-site", 4)
    quantity = r"(eval\[[ABC]\]@[0-9a-f]{64}|labels\[[ABC]\])"
    own = re.compile(rf"the releases expose this site's {quantity} by differencing")
    peer = re.compile(
        rf"with the evaluations this site took part in, the plan determines the {quantity} sum "
        r"of \{(site-\d)\} by differencing"
    )
    victims = set()
    for site, reason in _refusal_reasons(loop, run):
        if own.match(reason):
            victims.add(site)
        elif (found := peer.match(reason)) is not None:
            assert found.group(2) != site, reason
            victims.add(found.group(2))
        else:
            assert "< min cohort" in reason, reason  # a re-plan over too few sites
    assert "site-1" in victims, run.logs  # the first plan's victim, named by whoever decided
    _nothing_evaluated(loop, loot)


def test_a_weakened_sparse_graph_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    k = 8
    feats, _ = DATA.draw(k)
    settings = {
        **mask_round_settings(feats),
        "gram_scope": "global",
        "mask_graph": "sparse",
        "min_participants": 4,  # a degree-2 graph needs 4 sites; re-plans stop below that
    }
    loop = _prepare(tmp_path, k, settings)
    _shorten_wait(loop, 20.0)
    command = malicious_server.command("weaken-graph", tmp_path / "loot.json")
    run = run_loopback(loop, timeout_s=240, server_command=command, sites_per_process=k)
    assert set(run.client_rcs.values()) <= {EXIT_REFUSED, EXIT_ABORTED, 1}, run.logs
    reasons = [
        r["reason"]
        for site in loop.site_ids
        for r in run.reports[site].values()
        if r["outcome"] == "REFUSED_PLAN"
    ]
    assert reasons, run.logs
    for reason in reasons:
        assert reason.startswith("the sparse masking graph (k=2, t_N=2, "), reason
        assert "above this site's limit 2^-40" in reason
    for site in loop.site_ids:
        for report in run.reports[site].values():
            assert report["bytes_sent"] == 0 and "model" not in report
    _no_model_and_no_uploads_kept(loop, uploads=False)
