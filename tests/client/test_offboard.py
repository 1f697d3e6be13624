"""`afl-client offboard` (docs/operations.md §10.1, docs/protocol.md M-177): a site leaving erases
its statistics and feature caches and keeps a record of every file deleted, with the SHA-256
computed here from the bytes before deletion (the oracle); the DP ledger, history, reports and
models stay. Without --yes it only lists; a [data] cache that is not a feature cache is refused
with nothing deleted."""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from afl.client.cli import main as client_main
from afl.client.config import DataConfig, load_client_config
from afl.client.offboard import OffboardError, offboard_site
from afl.core.data.featurecache import CacheMeta, write_cache
from afl.ops.provisioning import ProvisionedFederation
from afl.server import toml_text
from tests.helpers.federation import FederationSpec

FEDERATION = FederationSpec(sites=["s1", "s2"])


def _site(federation: ProvisionedFederation, tmp_path: Path) -> Path:
    """A copy of s1's kit whose state holds statistics, a ledger and a report, with a cache."""
    kit = tmp_path / "kit"
    kit.mkdir()
    for f in federation.site_dirs["s1"].iterdir():
        if f.is_file():
            (kit / f.name).write_bytes(f.read_bytes())
    doc = tomllib.loads((kit / "client.toml").read_text())
    doc["data"] = {"cache": str(tmp_path / "cache"), "classes": []}
    doc["client"]["state_dir"] = str(tmp_path / "state")
    (kit / "client.toml").write_text(toml_text.dumps(doc))
    rng = np.random.default_rng(0)
    write_cache(
        tmp_path / "cache",
        meta=CacheMeta(n=4, d=3, classes=("a",), source="test", extra={"backbone": "test"}),
        ids=[str(i) for i in range(4)],
        labels=np.array([[0], [1], [0], [1]], dtype=np.int8),
        features=rng.normal(size=(4, 3)).astype(np.float32),
    )
    state = tmp_path / "state"
    for name, data in {
        "stats/local-k.npz": b"G and b of s1" * 100,
        "stats/pseudo-k.npz": b"projections" * 10,
        "dp-ledger/000001.json": b'{"seq": 1}',
        "reports/r1.json": b'{"outcome": "COMPLETED"}',
        "history.json": b'{"releases": []}',
    }.items():
        (state / name).parent.mkdir(parents=True, exist_ok=True)
        (state / name).write_bytes(data)
    return kit / "client.toml"


def test_offboarding_erases_stats_and_caches_with_a_record(
    federation: ProvisionedFederation, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = _site(federation, tmp_path)
    state, cache = tmp_path / "state", tmp_path / "cache"
    digests = {
        str(p.relative_to(root.parent)): hashlib.sha256(p.read_bytes()).hexdigest()
        for root in (state / "stats", cache)
        for p in root.rglob("*")
        if p.is_file()
    }
    assert client_main(["offboard", "--config", str(config_path)]) == 2  # lists only
    assert "add --yes" in capsys.readouterr().err and (state / "stats").exists()

    assert client_main(["offboard", "--config", str(config_path), "--yes"]) == 0
    assert "erased; record" in capsys.readouterr().out
    assert not (state / "stats").exists() and not cache.exists()
    for kept in ("dp-ledger/000001.json", "reports/r1.json", "history.json"):
        assert (state / kept).is_file(), kept
    (record_path,) = list((state / "offboarding").glob("*.json"))
    record = json.loads(record_path.read_text())
    assert record["site_id"] == "s1" and "dp-ledger/" in record["kept"]
    listed = {f["path"]: f["sha256"] for found in record["deleted"].values() for f in found}
    assert listed == digests  # every file deleted, each with the digest of its content


def test_a_cache_setting_that_is_not_a_feature_cache_deletes_nothing(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    config = load_client_config(_site(federation, tmp_path))
    other = tmp_path / "documents"
    other.mkdir()
    (other / "letter.txt").write_text("not a cache")
    with pytest.raises(OffboardError, match="not a feature cache"):
        offboard_site(replace(config, data=DataConfig(other)))
    assert (other / "letter.txt").exists() and (tmp_path / "state" / "stats").exists()
