"""An export carries the model's federation-log proof (M-198) and `afl-client evaluate` verifies
it with the site's kit before scoring (M-199): a genuine export is evaluated; a model not signed
by the kit's coordinator, a proof of another model, a wrong inclusion path, a checkpoint the
coordinator did not sign or one cosigned by fewer than the quorum, and a bare model file are
refused with one line; --unverified-model scores a bare file with a warning. The proofs are
built from a log signed and cosigned with the provisioned sites' real identity keys."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afl.client.cli import main as client_main
from afl.client.model.proof import PROOF_FILE, SIGNED_MODEL_FILE
from afl.core.data.featurecache import CacheMeta, write_cache
from afl.crypto.identity.signatures import generate_identity_key, public_key_to_raw
from afl.ops.provisioning import ProvisionedFederation
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.solve.model import build_signed_model
from tests.helpers.federation import FederationSpec, rewrite_client_toml
from tests.helpers.modelproof import release_proof, site_keys, write_proof

FEDERATION = FederationSpec(
    sites=["site-a", "site-b", "site-c"], port=50997, federation_id="fed-proof"
)
CLASSES = ("A", "B")
D = 6
ROUND = "r1-proof"


def _signed(key: Any, w: np.ndarray) -> bytes:
    signed = build_signed_model(
        w,
        identity_key=key,
        federation_id="fed-proof",
        round_id=ROUND,
        round_number=1,
        classes=CLASSES,
        gamma=1.0,
        backbone="resnet18",
        contributors=["site-a", "site-b", "site-c"],
        plan_bytes=b"plan",
    )
    return bytes(signed.SerializeToString())


@pytest.fixture(scope="module")
def fed(federation: ProvisionedFederation, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("proof")
    key = generate_identity_key()
    config = rewrite_client_toml(
        federation.site_dirs["site-a"],
        tmp,
        client={"state_dir": str(tmp / "state")},
        identity={"server_public_key": public_key_to_raw(key).hex()},
    )
    w = np.random.default_rng(3).normal(size=(D, len(CLASSES)))
    blob = _signed(key, w)
    digest = hashlib.sha256(pb.SignedModel.FromString(blob).model).hexdigest()
    witnesses = site_keys(federation.site_dirs)
    export = tmp / "export"
    export.mkdir()
    (export / SIGNED_MODEL_FILE).write_bytes(blob)
    proof = release_proof(
        federation="fed-proof", coordinator=key, model_sha256=digest, round_id=ROUND,
        witnesses=witnesses,
    )  # fmt: skip
    write_proof(export, proof)
    rng = np.random.default_rng(4)
    labels = (rng.random((40, 2)) < 0.5).astype(np.int8)
    meta = CacheMeta(n=40, d=D, classes=CLASSES, source="test")
    cache = tmp / "holdout"
    write_cache(
        cache, meta=meta, ids=[f"i{i}" for i in range(40)], labels=labels,
        features=rng.normal(size=(40, D)).astype(np.float32),
    )  # fmt: skip
    return {
        "tmp": tmp, "key": key, "config": config, "export": export, "digest": digest,
        "witnesses": witnesses, "cache": cache, "w": w,
    }  # fmt: skip


def _evaluate(fed: dict[str, Any], model: Path, *extra: str) -> int:
    argv = ["evaluate", "--config", str(fed["config"]), "--model", str(model)]
    return client_main([*argv, "--cache", str(fed["cache"]), "--bootstrap", "20", *extra])


def _variant(fed: dict[str, Any], name: str, **proof_changes: Any) -> Path:
    """A copy of the genuine export whose log-proof.json has ``proof_changes``."""
    out: Path = fed["tmp"] / name
    shutil.copytree(fed["export"], out)
    doc = json.loads((out / PROOF_FILE).read_text())
    doc.update(proof_changes)
    (out / PROOF_FILE).write_text(json.dumps(doc))
    return out


def _one_line_refusal(capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def test_a_genuine_export_is_verified_then_evaluated(fed, capsys) -> None:
    assert _evaluate(fed, fed["export"]) == 0
    out = capsys.readouterr().out
    assert "verified: in the federation log" in out and "site-a, site-b, site-c" in out
    report = json.loads((fed["tmp"] / "state" / "reports" / f"{ROUND}.json").read_text())
    assert report["local_evaluation"]["model_sha256"] == fed["digest"]


def test_a_fake_tampered_or_wrongly_proven_export_is_refused(fed, capsys) -> None:
    doc = json.loads((fed["export"] / PROOF_FILE).read_text())
    # an export without a proof: not from the federation
    bare = fed["tmp"] / "bare"
    bare.mkdir()
    shutil.copy(fed["export"] / SIGNED_MODEL_FILE, bare / SIGNED_MODEL_FILE)
    assert _evaluate(fed, bare) == 1
    _one_line_refusal(capsys, "not an export of this federation", "--unverified-model")
    # a model signed by another key, with the genuine proof beside it
    forged = _variant(fed, "forged")
    (forged / SIGNED_MODEL_FILE).write_bytes(_signed(generate_identity_key(), fed["w"]))
    assert _evaluate(fed, forged) == 1
    _one_line_refusal(capsys, "not signed by this federation's server")
    # the proof of another release of the same log
    other = release_proof(
        federation="fed-proof", coordinator=fed["key"], model_sha256="ab" * 32,
        round_id="r9-later", witnesses=fed["witnesses"],
    )  # fmt: skip
    assert _evaluate(fed, _variant(fed, "other", **other.to_json())) == 1
    _one_line_refusal(capsys, "not the release of model")
    # a wrong inclusion path, and a wrong index
    path = list(doc["inclusion_proof"])
    path[0] = ("00" if path[0][:2] != "00" else "11") + path[0][2:]
    assert _evaluate(fed, _variant(fed, "path", inclusion_proof=path)) == 1
    _one_line_refusal(capsys, "log proof is refused", "signed root")
    assert _evaluate(fed, _variant(fed, "index", index=doc["index"] + 1)) == 1
    _one_line_refusal(capsys, "log proof is refused")
    # one cosignature where the quorum of the three-site roster is two
    assert _evaluate(fed, _variant(fed, "few", cosignatures=doc["cosignatures"][:1])) == 1
    _one_line_refusal(capsys, "cosigned by 1 witness(es)", "quorum is 2")
    # a checkpoint the coordinator did not sign (another key, the same root)
    impostor = release_proof(
        federation="fed-proof", coordinator=generate_identity_key(), model_sha256=fed["digest"],
        round_id=ROUND, witnesses=fed["witnesses"],
    )  # fmt: skip
    assert _evaluate(fed, _variant(fed, "impostor", **impostor.to_json())) == 1
    _one_line_refusal(capsys, "not signed by the coordinator")


def test_a_bare_model_file_needs_the_override_which_warns(fed, capsys) -> None:
    bare = fed["tmp"] / "elsewhere" / "model.signed-model.pb"
    bare.parent.mkdir()
    shutil.copy(fed["export"] / SIGNED_MODEL_FILE, bare)
    assert _evaluate(fed, bare) == 1
    _one_line_refusal(capsys, "neither an `afl export` folder", "--unverified-model")
    assert _evaluate(fed, bare, "--unverified-model") == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and "NOT verified" in err
