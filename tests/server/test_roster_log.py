"""The roster in the federation log (M-220) and in every plan (M-221): the coordinator appends
its provisioned roster (every site's identity key and its digest) once, and again only when it
changes; every signed plan binds that digest; the digest computed from server.toml is the one
every site computes from its own kit's [peers] (two files, two code paths)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from afl.client.config import load_client_config
from afl.client.policy.roster import kit_roster, roster_problem
from afl.crypto.identity import signatures
from afl.crypto.transparency.statements import decode_statement, roster_digest
from afl.proto.v1 import common_pb2 as cpb
from afl.server.config import load_config
from afl.server.coordinator import Coordinator
from afl.server.store import Store
from tests.helpers.federation import FederationSpec
from tests.helpers.inprocess import complete_round, enrol

SITES = ["r1", "r2", "r3"]
FEDERATION = FederationSpec(
    sites=SITES,
    federation_id="fed-roster",
    round_settings={"classes": ["a", "b"], "feature_dim": 2, "min_participants": 3},
)


def _coordinator(federation: Any, state: Path) -> Coordinator:
    config = replace(load_config(federation.server_dir / "server.toml"), state_dir=state)
    key = signatures.load_private_key_pem((federation.server_dir / "identity.key").read_bytes())
    return Coordinator(config, Store(state, federation_id=config.federation_id), key)


def _rosters(coordinator: Coordinator) -> list[dict[str, object]]:
    store = coordinator.store
    return [
        decode_statement(entry, federation="fed-roster")[1]
        for _, kind, entry, _ in store.log_entries(0, store.log_size())
        if kind == "roster"
    ]


def test_the_roster_is_logged_and_every_plan_binds_its_digest(federation: Any, tmp_path: Path):
    coordinator = _coordinator(federation, tmp_path / "state")
    (logged,) = _rosters(coordinator)
    digest = bytes.fromhex(str(logged["roster_sha256"]))
    for site in SITES:
        kit = load_client_config(federation.site_dirs[site] / "client.toml")
        assert roster_digest(federation="fed-roster", keys=kit_roster(kit)) == digest
        assert logged["sites"][site] == kit.identity_public_key.hex()  # type: ignore[index]
    for site in SITES:
        enrol(coordinator, federation, site)
    complete_round(coordinator, federation)
    plans = [
        cpb.ReleasePlan.FromString(r.plan) for r in coordinator.store.rounds("run-1") if r.plan
    ]
    assert plans and all(p.roster_sha256 == digest for p in plans)
    kit = load_client_config(federation.site_dirs["r1"] / "client.toml")
    assert roster_problem(plans[0], config=kit) == ""
    coordinator.store.close()
    # a restart over the same roster logs nothing new
    again = _coordinator(federation, tmp_path / "state")
    assert len(_rosters(again)) == 1
    again.store.close()
