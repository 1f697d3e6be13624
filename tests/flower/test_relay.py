"""afl's coordinator and sites over Flower-style messages, without Flower (afl.flower.relay,
afl.flower.site; docs/flower.md): the relay and the sites exchange records exactly as the Flower
apps do (tests/helpers/flower_nodes.py), every site message handled by a fresh site as on the
deployment engine, its session sealed in between.

A masked round gives every site the W of the plaintext sums (oracle: the in-process solve on the
caches), one message per stage; a CKKS round, its decryptor a node too, gives W within the derived
CKKS bound of the plaintext W (tests/e2e/ckks_tolerance.py); a two-round plaintext run gives the W of afl's own daemons on the
same caches. Honest parties refuse: a node that claims another site cannot enrol or call as it;
sites refuse a plan their [policy] forbids and a plan whose signature does not verify (a
tampering transport): nothing is uploaded and nothing is released."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.client.config import load_client_config
from afl.core.aggregation import federated_solve
from afl.crypto.identity.signatures import load_private_key_pem, sign_fields
from afl.crypto.identity.signed_blobs import ENROL_CONTEXT
from afl.flower.envelope import Answer, Call, FromSite, Gate, ToSite
from afl.lab.demo.federation import (
    LoopbackFederation,
    run_loopback,
    site_reports,
)
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import load_config
from afl.server.store import Store
from tests.e2e.loopback import SiteData, cached_statistics
from tests.helpers.flower_nodes import (
    CLASSES,
    SiteNode,
    ckks_reference,
    serve,
    site_nodes,
    small_federation,
)
from tests.helpers.numeric import relative_error

D = 16
DATA = SiteData(d=D, classes=len(CLASSES), rows=120, rows_step=20, positive_rate=0.4, seed=11)
MASK_MESSAGES = 9  # hello, challenge, plan, the five masked stages, the model


def _federation(root: Path, **kwargs: Any) -> LoopbackFederation:
    return small_federation(root, DATA, **kwargs)


def _final(reports: dict[str, dict[str, Any]], site: str) -> dict[str, Any]:
    rounds = list(reports[site].values())
    assert rounds, f"{site} wrote no report"
    return max(rounds, key=lambda r: (r.get("round_number", 0), r.get("_mtime", 0)))


def _w(report: dict[str, Any]) -> NDArray[np.float64]:
    assert report["outcome"] == "COMPLETED", report
    return np.asarray(np.load(report["model"]["path"]), dtype=np.float64)


def test_a_masked_round_over_the_relay_gives_every_site_the_plaintext_w(tmp_path: Path) -> None:
    fed = _federation(tmp_path)
    outcome, transport = serve(fed, site_nodes(fed, fresh_process=True))
    assert (outcome.state, outcome.sites) == ("published", fed.site_ids), outcome
    stats, _ = cached_statistics(fed, list(fed.site_ids))
    w_ref, _ = federated_solve(stats, gamma=1.0, gram_scope="global")
    reports = site_reports(fed)
    for site in fed.site_ids:
        report = _final(reports, site)
        assert relative_error(_w(report), w_ref) <= 1e-9
        assert report["plan"]["aggregation"] == "AGGREGATION_MODE_MASK"
        assert report["model"]["contributors"] == list(fed.site_ids)
        slots = {u["slot"] for u in report["uploads"]}
        assert {"mask/advertise-keys", "mask/share-keys", "gram[all]", "mask/unmask"} <= slots
    # One message per stage: nothing is polled.
    per_node = [sum(1 for node, _, _ in transport.exchanges if node == n) for n in (1, 2, 3)]
    assert per_node == [MASK_MESSAGES] * 3


def test_a_ckks_round_over_the_relay_with_its_decryptor_node_gives_the_plaintext_w(
    tmp_path: Path,
) -> None:
    fed = _federation(tmp_path, mode="ckks")
    outcome, transport = serve(fed, site_nodes(fed, fresh_process=True))
    assert outcome.state == "published", outcome
    assert set(outcome.sites) == {*fed.site_ids, "decryptor"}
    w_plain, tol = ckks_reference(fed, DATA)
    reports = site_reports(fed)
    for site in fed.site_ids:
        report = _final(reports, site)
        assert report["plan"]["aggregation"] == "AGGREGATION_MODE_CKKS"
        assert np.all(np.linalg.norm(_w(report) - w_plain, axis=0) <= tol)
    # The decryptor decrypted every release once, through its own node.
    decryptor = max(transport.handlers)
    calls = [c.method for n, _, r in transport.exchanges if n == decryptor and r for c in r.calls]
    assert calls.count("ReportDecryption") >= 1
    assert "PublishCkksContext" in calls


def test_two_plaintext_rounds_over_the_relay_equal_afl_s_daemons(tmp_path: Path) -> None:
    settings: dict[str, Any] = {"mode": "plaintext", "rounds": 2, "allow_plaintext": True}
    fed = _federation(tmp_path / "flower", **settings)
    outcome, _ = serve(fed, site_nodes(fed))
    assert outcome.state == "published", outcome
    daemons = _federation(tmp_path / "daemons", **settings)
    run = run_loopback(daemons, timeout_s=300)
    assert run.client_rcs == dict.fromkeys(daemons.site_ids, 0), run.logs
    reports = site_reports(fed)
    for site in fed.site_ids:
        mine, theirs = _final(reports, site), run.final_report(site)
        assert mine["round_number"] == theirs["round_number"] == 2
        assert relative_error(_w(mine), _w(theirs)) <= 1e-9


class _Impostor:
    """A node that says it is site-1 but holds site-2's kit: it proves enrolment with site-2's
    key, then uploads and reads the round configuration as site-1 anyway."""

    def __init__(self, fed: LoopbackFederation) -> None:
        self.kit = load_client_config(fed.client_configs["site-2"])
        self.key = load_private_key_pem(self.kit.identity_key_path.read_bytes())
        self.seen: list[Answer] = []

    def __call__(self, message: ToSite) -> FromSite:
        self.seen += [*message.results, *message.answers]
        if not self.seen:
            return FromSite("site-1", gate=Gate("now"), gets=(Call("GetEnrolChallenge", b""),))
        if len(self.seen) == 1:
            challenge = pb.EnrolChallenge.FromString(message.answers[0].response[0])
            request = pb.EnrollRequest(
                identity_public_key=self.kit.identity_public_key,
                protocol_version=wire.PROTOCOL_VERSION,
                challenge=challenge.nonce,
                feature_dim=D,
            )
            request.proof = sign_fields(
                self.key,
                context=ENROL_CONTEXT,
                fields=wire.enrol_proof_fields(
                    request,
                    federation_id=self.kit.federation_id,
                    site_id="site-1",
                    server_identity_public_key=self.kit.server_public_key,
                ),
            )
            chunk = next(wire.iter_chunks(bytes(64), round_id="", release_name="gram[all]"))
            calls = (
                Call("Enroll", request.SerializeToString()),
                Call("Upload", chunk.SerializeToString()),
            )
            gets = (Call("GetRoundConfig", cpb.RoundRef().SerializeToString()),)
            return FromSite("site-1", calls=calls, gate=Gate("now"), gets=gets)
        return FromSite("site-1", gate=Gate("end"))


def test_a_node_claiming_another_site_can_neither_enrol_nor_act_as_it(tmp_path: Path) -> None:
    fed = _federation(tmp_path)
    nodes = site_nodes(fed)
    impostor = nodes[4] = _Impostor(fed)
    outcome, _ = serve(fed, nodes)
    assert (outcome.state, outcome.sites) == ("published", fed.site_ids), outcome
    refused = {a.method: a.error for a in impostor.seen if a.error}
    assert refused["Enroll"].startswith("PERMISSION_DENIED: identity key differs")
    assert "has not enrolled as site-1" in refused["Upload"]
    assert "has not enrolled as site-1" in refused["GetRoundConfig"]
    config = load_config(fed.server_config)
    store = Store(config.state_dir, federation_id=config.federation_id)
    try:
        site_1 = load_client_config(fed.client_configs["site-1"]).identity_public_key
        assert store.enrolments()["site-1"].identity_public_key == site_1
        round_id = _final(site_reports(fed), "site-1")["round_id"]
        uploads = store.uploads(round_id)
        assert {site for site, _ in uploads} == set(fed.site_ids)
        junk = hashlib.sha256(bytes(64)).digest()
        assert all(row.sha256 != junk for row in uploads.values())
    finally:
        store.close()


def _uploads(fed: LoopbackFederation) -> int:
    config = load_config(fed.server_config)
    store = Store(config.state_dir, federation_id=config.federation_id)
    try:
        return sum(len(store.uploads(r.round_id)) for r in store.rounds())
    finally:
        store.close()


def test_sites_refuse_a_plan_their_policy_forbids(tmp_path: Path) -> None:
    fed = _federation(tmp_path, mode="plaintext")  # the kits allow mask and ckks only
    outcome, _ = serve(fed, site_nodes(fed))
    assert outcome.state == "aborted" and "plan refused" in outcome.reason, outcome
    for site in fed.site_ids:
        report = _final(site_reports(fed), site)
        assert report["outcome"] == "REFUSED_PLAN"
        assert "'plaintext' is not allowed by this site's policy" in report["reason"]
    assert _uploads(fed) == 0


class _Tampering:
    """A transport that changes the release plan it hands to a site (the operator's Flower side
    is not trusted by the sites)."""

    def __init__(self, node: SiteNode) -> None:
        self.node = node

    def __call__(self, message: ToSite) -> FromSite:
        answers = []
        for answer in message.answers:
            if answer.method == "GetRoundConfig" and answer.response:
                config = pb.RoundConfig.FromString(answer.response[0])
                plan = cpb.ReleasePlan.FromString(config.release_plan.plan)
                plan.operator_override = True
                config.release_plan.plan = plan.SerializeToString()
                answer = Answer(answer.method, answer.request, (config.SerializeToString(),))
            answers.append(answer)
        return self.node(ToSite(message.federation_id, message.results, tuple(answers)))


def test_a_site_refuses_a_plan_whose_signature_does_not_verify(tmp_path: Path) -> None:
    fed = _federation(tmp_path, upload_timeout_s=20.0)  # the plan deadline has to pass
    nodes = site_nodes(fed)
    nodes[1] = _Tampering(SiteNode(fed.client_configs["site-1"]))
    outcome, _ = serve(fed, nodes)
    # Its refusal names no plan the coordinator signed, so the round ends at the plan deadline.
    assert outcome.state == "aborted", outcome
    assert outcome.reason == "timed out waiting for the plan decision of site-1"
    report = _final(site_reports(fed), "site-1")
    assert report["outcome"] == "REFUSED_PLAN"
    assert "not signed by this federation's server" in report["reason"]
    assert _uploads(fed) == 0


class _Recording:
    """A site node that keeps every message it was handed and its sealed session before it."""

    def __init__(self, node: SiteNode) -> None:
        self.node = node
        self.seen: list[tuple[ToSite, bytes | None]] = []

    def __call__(self, message: ToSite) -> FromSite:
        self.seen.append((message, self.node.sealed))
        return self.node(message)


def test_a_round_replayed_to_a_site_that_took_part_is_refused(tmp_path: Path) -> None:
    """The operator's Flower side hands a site the plan of a round it already uploaded to (with
    the session it had then): a replay would have it upload again, with fresh DP noise or for a
    sum without another site. The site sends nothing and keeps its report of the round."""
    fed = _federation(tmp_path)
    nodes = site_nodes(fed)
    recording = _Recording(SiteNode(fed.client_configs["site-1"]))
    nodes[1] = recording
    outcome, _ = serve(fed, nodes)
    assert outcome.state == "published", outcome
    before = _final(site_reports(fed), "site-1")
    assert before["outcome"] == "COMPLETED"
    plan_message, sealed = next(
        (m, s)
        for m, s in recording.seen
        if any(a.method == "GetRoundConfig" and a.response for a in m.answers)
    )
    recording.node.sealed = sealed
    reply = recording.node(plan_message)
    assert reply.gate == Gate("end"), reply
    assert not [c for c in reply.calls if c.method in ("RespondToPlan", "Upload")], reply
    after = _final(site_reports(fed), "site-1")
    assert after["outcome"] == "COMPLETED" and after["round_id"] == before["round_id"]


class _DroppingReceipts:
    """A transport that drops the coordinator's upload receipts on their way to a site."""

    def __init__(self, node: SiteNode) -> None:
        self.node = node

    def __call__(self, message: ToSite) -> FromSite:
        results = tuple(r for r in message.results if r.method != "Upload")
        return self.node(ToSite(message.federation_id, results, message.answers))


def test_a_site_whose_upload_receipts_are_dropped_fails_its_round(tmp_path: Path) -> None:
    """The site cannot tell what the coordinator received: it does not report the round as
    completed (the others, whose receipts came, do)."""
    fed = _federation(tmp_path, mode="plaintext", allow_plaintext=True)
    nodes = site_nodes(fed)
    nodes[1] = _DroppingReceipts(SiteNode(fed.client_configs["site-1"]))
    outcome, _ = serve(fed, nodes)
    assert outcome.state == "published", outcome
    reports = site_reports(fed)
    failed = _final(reports, "site-1")
    assert failed["outcome"] == "FAILED" and "model" not in failed
    assert "the coordinator's message carries no receipt" in failed["reason"]
    for site in fed.site_ids[1:]:
        assert _final(reports, site)["outcome"] == "COMPLETED"
