"""Attack 6 of the federation-log issue through the real daemons (docs/protocol.md M-221): a site
whose kit was given a roster in which a peer's identity key is the operator's (it skipped the
out-of-band fingerprint comparison at import) is told by every plan: the plan binds the digest of
the coordinator's logged roster, which is not its kit's. It refuses before it sends anything;
the others go on without it and the model holds nothing of it."""

from __future__ import annotations

import re
from pathlib import Path

from afl.crypto.identity.signatures import generate_identity_key, public_key_to_raw
from afl.lab.demo.federation import mask_round_settings, run_loopback
from afl.proto.v1 import coordinator_pb2 as pb
from tests.adversarial.test_malicious_coordinator import DATA, _prepare, _shorten_wait, _store

K = 4
VICTIM, IMPERSONATED = "site-1", "site-2"


def test_a_kit_with_a_poisoned_roster_refuses_every_plan_and_sends_nothing(tmp_path: Path) -> None:
    feats, _ = DATA.draw(K)
    loop = _prepare(tmp_path, K, {**mask_round_settings(feats), "min_participants": K - 1})
    _shorten_wait(loop, 20.0)
    config = loop.client_configs[VICTIM]
    operator = public_key_to_raw(generate_identity_key().public_key()).hex()
    text, n = re.subn(
        rf'^("?{IMPERSONATED}"?\s*=\s*)"[0-9a-f]+"',
        rf'\g<1>"{operator}"',
        config.read_text(),
        flags=re.M,
    )
    assert n == 1, text  # the victim's [peers] entry of site-2 is now the operator's key
    config.write_text(text)
    run = run_loopback(loop, timeout_s=240)
    log = run.logs[VICTIM].read_text()
    assert run.client_rcs[VICTIM] == 3, log[-3000:]
    refused = [r for r in run.reports[VICTIM].values() if r["outcome"] == "REFUSED_PLAN"]
    assert refused and all(r["bytes_sent"] == 0 for r in run.reports[VICTIM].values())
    assert "this site's [peers] roster is" in refused[0]["reason"]
    assert "fingerprint" in refused[0]["reason"]
    others = [s for s in loop.site_ids if s != VICTIM]
    assert all(run.client_rcs[s] == 0 for s in others), {s: run.client_rcs[s] for s in others}
    store = _store(loop)
    try:
        model = store.model()
        assert model is not None
        assert set(pb.Model.FromString(model[1]).contributors) == set(others)
        uploads = [row for r in store.rounds() for row in store.uploads(r.round_id).values()]
        assert uploads and VICTIM not in {row.site_id for row in uploads}
    finally:
        store.close()
