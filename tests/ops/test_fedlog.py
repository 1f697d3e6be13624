"""`afl log` (docs/protocol.md §11a, M-194): a reviewer handed an export of the federation log
verifies, offline, the coordinator's checkpoints, their consistency, the witnesses'
cosignatures and a plan's inclusion; a tampered statement, a forged cosignature or a checkpoint
of another history (a site's split-view evidence) fails, each in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afl.crypto.identity import signatures
from afl.crypto.transparency.checkpoint import Checkpoint, cosign, sign_checkpoint
from afl.crypto.transparency.merkle import leaf_hash
from afl.lab.cli import main
from afl.proto import wire
from tests.helpers.federation import FederationSpec
from tests.helpers.inprocess import complete_round, enrolled_coordinator, site_key

SITES = ["p1", "p2", "p3"]
FEDERATION = FederationSpec(
    sites=SITES, round_settings={"classes": ["a"], "feature_dim": 2, "min_participants": 3}
)


def _afl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["log", *argv])
    return code, capsys.readouterr().out


def test_a_reviewer_verifies_the_exported_log_offline(
    federation: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server_dir: Path = federation.server_dir  # type: ignore[attr-defined]
    coordinator = enrolled_coordinator(federation, SITES)
    config = coordinator.config
    key = signatures.load_private_key_pem((server_dir / "identity.key").read_bytes())
    first = coordinator.log_checkpoint("p1")  # before the run: the enrolments
    for site in ("p1", "p2"):
        checkpoint = wire.checkpoint_from_proto(first.checkpoint).checkpoint
        c = cosign(site_key(federation, site), witness=site, checkpoint=checkpoint)
        coordinator.log_cosign(site, wire.cosignature_to_proto(c))
    round_id = coordinator.find("").round_id
    complete_round(coordinator, federation)
    second_signed = wire.checkpoint_from_proto(coordinator.log_checkpoint("p1").checkpoint)
    second = second_signed.checkpoint
    c = cosign(site_key(federation, "p3"), witness="p3", checkpoint=second)
    coordinator.log_cosign("p3", wire.cosignature_to_proto(c))
    export = tmp_path / "log.json"
    assert (
        _afl(capsys, "export", "--config", str(server_dir / "server.toml"), "--out", str(export))[0]
        == 0
    )

    code, out = _afl(capsys, "verify", str(export))
    assert code == 0, out
    assert f"checkpoint size {first.checkpoint.size} " in out
    assert "cosigned by 2/3 (quorum 2): p1, p2" in out
    assert "cosigned by 1/3 (below quorum 2): p3" in out
    code, out = _afl(capsys, "show", str(export))
    assert code == 0 and f"round_id={round_id}" in out and " release " in out, out
    code, out = _afl(capsys, "prove", str(export), "--round", round_id)
    assert code == 0 and "inclusion proof verifies" in out, out

    doc = json.loads(export.read_text())
    # A site's log-witness.json with a checkpoint of this log verifies against it; a checkpoint
    # the coordinator signed over another history (split-view evidence) does not.
    witness_file = tmp_path / "log-witness.json"
    witness_file.write_text(json.dumps({"checkpoint": {
        "federation": config.federation_id, "size": second.size, "root": second.root.hex(),
        "signature": first.checkpoint.signature.hex()}}))  # fmt: skip
    other = sign_checkpoint(key, Checkpoint(config.federation_id, second.size, leaf_hash(b"x")))
    evidence = tmp_path / "split-view.json"
    evidence.write_text(json.dumps({"offered": {
        "federation": config.federation_id, "size": second.size, "root": leaf_hash(b"x").hex(),
        "signature": other.signature.hex()}}))  # fmt: skip
    code, out = _afl(capsys, "verify", str(export), "--checkpoint", str(evidence))
    assert code == 1 and "is not a checkpoint of this log (a split view)" in out, out
    code, out = _afl(capsys, "verify", str(export), "--checkpoint", str(witness_file))
    assert code == 1 and "not signed by the coordinator" in out, out  # wrong signature copied
    held = json.loads(witness_file.read_text())
    held["checkpoint"]["signature"] = second_signed.signature.hex()
    witness_file.write_text(json.dumps(held))
    code, out = _afl(capsys, "verify", str(export), "--checkpoint", str(witness_file))
    assert code == 0 and "is a checkpoint of this log" in out, out

    tampered = json.loads(json.dumps(doc))
    tampered["entries"][-1]["statement"] = tampered["entries"][0]["statement"]
    (tmp_path / "t.json").write_text(json.dumps(tampered))
    code, out = _afl(capsys, "verify", str(tmp_path / "t.json"))
    assert code == 1 and "is not a root of these statements" in out, out
    forged = json.loads(json.dumps(doc))
    forged["cosignatures"][0]["signature"] = "00" * 64
    (tmp_path / "f.json").write_text(json.dumps(forged))
    code, out = _afl(capsys, "verify", str(tmp_path / "f.json"))
    assert code == 1 and "does not verify" in out, out
    code, out = _afl(capsys, "verify", str(tmp_path / "missing.json"))
    assert code == 2 and "is not a federation log export" in out, out
    coordinator.store.close()
