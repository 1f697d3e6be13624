"""CKKS mode end to end over loopback mTLS (docs/protocol.md §4.3): afl-server, a dedicated
decryptor site and one afl-client per data site. The CKKS W must equal the plaintext W within the
bound DERIVED in docs/protocol.md ("CKKS precision"; tests/e2e/ckks_tolerance.py), and the macro AUC
must differ by < 1e-4."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from afl.core.aggregation import federated_solve
from afl.core.data.featurecache import open_cache
from afl.core.metrics import evaluate, predict_proba
from afl.crypto.ckks import scheme as ckks
from afl.lab.demo.federation import ckks_round_settings, prepare_loopback, run_loopback
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.store import Store
from tests.e2e.ckks_tolerance import entry_bound, w_tolerance
from tests.e2e.loopback import SiteData, cached_statistics

D = 24
CLASSES = ("A", "B", "C")
K = 3
GAMMA = 1.0
DATA = SiteData(
    d=D, classes=len(CLASSES), rows=220, rows_step=25, positive_rate=0.35, seed=11, signal=0.6
)


def test_ckks_federation_matches_plaintext_within_derived_bound(tmp_path: Path) -> None:
    feats, labels = DATA.draw(K + 1)  # the last block is the test set
    active = np.ones((K, len(CLASSES)), dtype=bool)
    active[0, 2] = False  # task heterogeneity: site-1 does not label C
    settings = {**ckks_round_settings(feats[:K]), "gamma": GAMMA, "gram_scope": "global"}
    loop = prepare_loopback(
        tmp_path,
        classes=CLASSES,
        site_features=feats[:K],
        site_labels=labels[:K],
        active=active,
        test_features=feats[K],
        test_labels=labels[K],
        round_settings=settings,
        decryptor=True,
    )
    run = run_loopback(loop, timeout_s=240)
    assert run.client_rcs == dict.fromkeys(loop.site_ids, 0), run.logs
    report = run.final_report("site-1")
    assert report["outcome"] == "COMPLETED" and report["model"]["signature_valid"]
    for site in loop.site_ids:  # each ciphertext from a drawn encryption of zero or on the spot
        counts = run.final_report(site)["ckks"]  # (M-237: which, depends on timing)
        assert counts["ciphertexts"] == 1 + len(CLASSES) and 0 <= counts["drawn_ahead"] <= 4
    w_ckks = np.asarray(np.load(report["model"]["path"]), dtype=np.float64)
    # Ciphertexts went up, not float64: one 131 KB-class ciphertext per 4095 values at least.
    packed = D * (D + 1) // 2
    assert report["bytes_sent"] > 8 * (packed + len(CLASSES) * D) * 10

    stats, _ = cached_statistics(loop, loop.site_ids)
    w_plain, _ = federated_solve(stats, gamma=GAMMA, gram_scope="global")
    gram = np.sum([s.gram for s in stats], axis=0)
    gram_bound, vector_bound = settings["ckks_gram_bound"], settings["ckks_vector_bound"]
    assert isinstance(gram_bound, float) and isinstance(vector_bound, float)
    assert max(float(np.abs(s.gram).max()) for s in stats) <= gram_bound  # declared bounds hold
    assert max(float(np.abs(s.b).max()) for s in stats) <= vector_bound
    tol = w_tolerance(
        gram=gram,
        weights=w_plain,
        gamma=GAMMA,
        eps_gram=entry_bound(bound=gram_bound, members=K),
        eps_b=entry_bound(bound=vector_bound, members=K),
    )
    err = np.linalg.norm(w_ckks - w_plain, axis=0)
    print("CKKS |dW| per class", err, "derived bound", tol)
    assert np.all(err <= tol), (err, tol)
    assert np.all(tol <= 1e-7 * np.linalg.norm(w_plain, axis=0))  # the bound is not vacuous
    assert not np.array_equal(w_ckks, w_plain) or np.all(err == 0)

    test = open_cache(loop.test_cache)
    auc = [
        evaluate(predict_proba(test.features, w), test.labels, classes=CLASSES).macro_auc
        for w in (w_ckks, w_plain)
    ]
    assert abs(auc[0] - auc[1]) < 1e-4

    # The secret key stayed with the decryptor; the server persisted only a PUBLIC context.
    secret = loop.provisioned.site_dirs["decryptor"] / "state" / "ckks" / "private_context.bin"
    assert secret.stat().st_mode & 0o777 == 0o600
    stored = loop.provisioned.server_dir / "state" / "ckks" / "context.bin"
    assert not ckks.load_public_context(stored.read_bytes()).is_private()
    server_log = [
        json.loads(x) for x in run.logs["server"].read_text().splitlines() if x[:1] == "{"
    ]
    assert not any(e.get("level") == "error" for e in server_log)

    # What was decrypted is on record (docs/protocol.md M-162, M-163): one "ckks-decryption"
    # record per planned release with its members and result digest, and the decryptor's signed
    # outcomes kept whole past the payload purge.
    state = Store(
        loop.provisioned.server_dir / "state",
        federation_id=loop.provisioned.federation_id,
        read_only=True,
    )
    [round_row] = state.rounds()
    assert round_row.plan is not None
    planned = {
        r.name: list(r.member_site_ids) for r in cpb.ReleasePlan.FromString(round_row.plan).releases
    }
    records = [d for _, e, d, _, _ in state.audit_entries() if e == "ckks-decryption"]
    assert {d["release"]: d["members"] for d in records} == planned
    assert all(len(bytes.fromhex(str(d["result_sha256"]))) == 32 for d in records)
    outcomes = [e for e in state.evidence(round_row.round_id) if e.kind.startswith("ckks-outcome:")]
    assert len(outcomes) == len(planned) and all(e.data for e in outcomes)
    for kept in outcomes:
        outcome = pb.DecryptionOutcome.FromString(kept.data or b"")
        assert outcome.result_sha256.hex() == next(
            d["result_sha256"] for d in records if d["release"] == outcome.release_name
        )


def test_a_ckks_run_that_lost_a_site_during_its_uploads_publishes_over_the_others(
    tmp_path: Path,
) -> None:
    """M-235 through the daemons: site-4 logs its opening of the round and is lost before its
    ciphertexts (tests/e2e/vanishing_client.py). The upload stage times out, the round aborts
    (never decrypted: no `decrypting` statement of it is in the log) and the coordinator
    re-plans over the three sites that uploaded. Every opening of the aborted round counted it
    as released over all four until the decryptor's statement existed, so the re-plan differed
    from it by site-4 alone and every site refused it; now the run publishes the three sites'
    model (the oracle: a plaintext solve of their statistics)."""
    from afl.crypto.transparency.statements import decode_statement
    from tests.e2e import vanishing_client
    from tests.e2e.faults.harness import federation
    from tests.e2e.processes import Daemons
    from tests.helpers.numeric import relative_error

    loop = federation(
        tmp_path,
        "ckks",
        sites=4,
        serve=True,
        round_settings={"min_participants": 3, "upload_timeout_s": 20.0},
    )
    daemons = Daemons(loop)
    try:
        daemons.start_server()
        daemons.start_clients(commands={"site-4": vanishing_client.command("opening")})
        run = daemons.wait_run("run-1")
        assert run.state == "published", (run, daemons.log_tail())
        assert daemons.clients["site-4"].wait(timeout=120) == vanishing_client.EXIT_CODE
    finally:
        daemons.stop()

    store = Store(loop.server_config.parent / "state", federation_id=loop.provisioned.federation_id)
    try:
        lost, replanned = store.rounds("run-1")
        fed = loop.provisioned.federation_id
        statements = [
            decode_statement(entry, federation=fed)
            for _, _, entry, _ in store.log_entries(0, store.log_size())
        ]
        aborted = {f["round_id"] for kind, f in statements if kind == "round-aborted"}
        decrypting = {f["round_id"] for kind, f in statements if kind == "decrypting"}
        opened = {
            f["site"]
            for kind, f in statements
            if kind == "opening" and f["round_id"] == lost.round_id
        }
        assert lost.round_id in aborted and lost.round_id not in decrypting, statements
        assert opened == {"site-1", "site-2", "site-3", "site-4"}, opened
        assert replanned.round_id in decrypting
        model = store.model(replanned.round_id)
        assert model is not None
        published = pb.Model.FromString(model[1])
    finally:
        store.close()
    three = ["site-1", "site-2", "site-3"]
    assert sorted(published.contributors) == three
    stats, _ = cached_statistics(loop, three)
    w_ref, _ = federated_solve(stats, gamma=1.0, gram_scope="global")
    w = np.frombuffer(published.weights.data, dtype="<f8").reshape(w_ref.shape)
    assert relative_error(w, w_ref) <= 1e-4
    everyone, _ = cached_statistics(loop, [*three, "site-4"])
    w_four, _ = federated_solve(everyone, gamma=1.0, gram_scope="global")
    assert relative_error(w_four, w_ref) > 1e-3  # the oracle tells the two models apart
