"""Site retention (docs/operations.md §10, docs/protocol.md M-179): ``[retention]`` of client.toml
erases expired statistics, reports and older models, each listed with the SHA-256 computed here
from the bytes before deletion (the oracle); the daemon applies it at start-up, before it loads
its statistics, and the DP ledger, history and upload register are never touched."""

from __future__ import annotations

import hashlib
import json
import os
import time
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from afl.client.config import ConfigError, RetentionConfig, load_client_config
from afl.client.daemon.loop import ClientDaemon
from afl.client.retention import enforce_retention
from afl.ops.provisioning import ProvisionedFederation
from afl.server import toml_text
from tests.client.test_offboard import _site
from tests.helpers.federation import FederationSpec

FEDERATION = FederationSpec(sites=["s1", "s2"])
_DAY = 86_400.0


def _age(path: Path, days: float) -> None:
    then = time.time() - days * _DAY
    os.utime(path, (then, then))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_expired_files_are_erased_and_listed_by_digest(tmp_path: Path) -> None:
    state = tmp_path / "state"
    files = {
        "stats/local-old.npz": 10, "stats/local-new.npz": 0, "reports/r1.json": 40,
        "reports/r2.json": 1, "models/r1.signed-model.pb": 3, "models/r1.weights.npy": 3,
        "models/r2.signed-model.pb": 2, "models/r2.weights.npy": 2,
        "models/r3.signed-model.pb": 1, "dp-ledger/000001.json": 400, "history.json": 400,
        "uploads/r1.json": 400,
    }  # fmt: skip
    for name, days in files.items():
        (state / name).parent.mkdir(parents=True, exist_ok=True)
        (state / name).write_bytes(f"content of {name}".encode() * 7)
        _age(state / name, days)
    expired = [
        "stats/local-old.npz", "reports/r1.json", "models/r1.signed-model.pb",
        "models/r1.weights.npy",
    ]  # fmt: skip
    digests = {name: _digest(state / name) for name in expired}
    settings = RetentionConfig(stats_days=7, reports_days=30, models_keep=2)
    record_path = enforce_retention(state, settings, site_id="s1")
    assert record_path is not None and record_path.parent == state / "retention"
    assert record_path.stat().st_mode & 0o077 == 0
    for name in files:
        assert (state / name).exists() == (name not in expired), name
    record = json.loads(record_path.read_text())
    listed = {f["path"]: f["sha256"] for found in record["deleted"].values() for f in found}
    assert listed == digests and record["settings"]["models_keep"] == 2
    assert enforce_retention(state, settings, site_id="s1") is None  # nothing left to expire
    assert enforce_retention(state, RetentionConfig(), site_id="s1") is None  # unset: kept


def test_the_daemon_erases_expired_statistics_at_start_up(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    config_path = _site(federation, tmp_path)
    doc = tomllib.loads(config_path.read_text())
    doc["retention"] = {"stats_days": 1, "reports_days": 90}
    doc["client"]["server"] = "127.0.0.1:1"  # nothing listens: the daemon stops after start-up
    doc["client"]["retry_attempts"] = 1
    config_path.write_text(toml_text.dumps(doc))
    config = load_client_config(config_path)
    assert config.retention == RetentionConfig(stats_days=1.0, reports_days=90.0)
    state = tmp_path / "state"
    old = state / "stats" / "local-k.npz"
    digest = _digest(old)
    _age(old, 2)
    daemon = ClientDaemon(replace(config, timing=replace(config.timing, rpc_timeout_s=1.0)))
    with pytest.raises(Exception):  # noqa: B017 (unreachable coordinator; any refusal)
        daemon.run()
    assert not old.exists() and (state / "stats" / "pseudo-k.npz").exists()  # fresh: kept
    assert (state / "reports" / "r1.json").exists() and (state / "dp-ledger").is_dir()
    assert daemon.stats is not None  # loaded after the purge: recomputed from the cache
    (record_path,) = list((state / "retention").glob("*.json"))
    record = json.loads(record_path.read_text())
    assert record["deleted"] == {
        "stats_days": [{"path": "stats/local-k.npz", "sha256": digest, "size": 1300}]
    }


def test_a_misspelt_retention_key_is_refused(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    config_path = _site(federation, tmp_path)
    doc = tomllib.loads(config_path.read_text())
    doc["retention"] = {"stat_days": 1}
    config_path.write_text(toml_text.dumps(doc))
    with pytest.raises(ConfigError, match="stats_days"):
        load_client_config(config_path)
