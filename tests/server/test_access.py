"""Need-to-know access to a run's model (docs/protocol.md M-160, M-161), in process: the run's
participants read it, a site outside the run and the decryptor are refused (and the refusal is
recorded), ``[access] need_to_know = false`` opens it to every enrolled site, and an admin name
not listed in [admins] is recorded when refused."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from afl.crypto.identity import signatures
from afl.server.admin import AdminRequests
from afl.server.config import load_config
from afl.server.coordinator import Coordinator
from afl.server.errors import NotPermittedError, WrongStageError
from afl.server.store import Store
from tests.helpers.federation import FederationSpec
from tests.helpers.inprocess import complete_round, enrol

RUN = ["p1", "p2", "p3"]
FEDERATION = FederationSpec(
    sites=[*RUN, "p4", "dec"],
    decryptor="dec",
    round_settings={
        "classes": ["a", "b"],
        "feature_dim": 2,
        "min_participants": 3,
        "participants": RUN,
    },
)


def _published(federation: Any, state: Path, **config_changes: Any) -> Coordinator:
    """A coordinator whose run-1 (p1-p3) published its model; p4 and the decryptor enrolled."""
    config = replace(
        load_config(federation.server_dir / "server.toml"), state_dir=state, **config_changes
    )
    key = signatures.load_private_key_pem((federation.server_dir / "identity.key").read_bytes())
    coordinator = Coordinator(config, Store(state, federation_id=config.federation_id), key)
    for site in [*RUN, "p4", "dec"]:
        enrol(coordinator, federation, site)
    complete_round(coordinator, federation)
    assert coordinator.store.model() is not None
    return coordinator


def _events(coordinator: Coordinator, event: str) -> list[dict[str, object]]:
    return [d for _, e, d, _, _ in coordinator.store.audit_entries() if e == event]


def test_only_the_runs_participants_read_its_model(federation: Any, tmp_path: Path) -> None:
    coordinator = _published(federation, tmp_path / "state")
    round_id = coordinator.store.rounds("run-1")[0].round_id
    signed = coordinator.model("p1", round_id)
    assert coordinator.model("p2").model == signed.model  # "": the latest it may read
    for outsider in ("p4", "dec"):
        with pytest.raises(NotPermittedError, match="need-to-know"):
            coordinator.model(outsider, round_id)
        with pytest.raises(WrongStageError, match="took part in"):
            coordinator.model(outsider)
    reads = _events(coordinator, "model-read")
    digest = hashlib.sha256(signed.model).hexdigest()
    assert [(d["site_id"], d["round_id"], d["sha256"]) for d in reads] == [
        ("p1", round_id, digest),
        ("p2", round_id, digest),
    ]
    refused = _events(coordinator, "read-refused")
    assert [(d["site_id"], d["what"]) for d in refused] == [("p4", "model"), ("dec", "model")]


def test_need_to_know_off_opens_the_model_to_every_enrolled_site(
    federation: Any, tmp_path: Path
) -> None:
    coordinator = _published(federation, tmp_path / "state", need_to_know=False)
    round_id = coordinator.store.rounds("run-1")[0].round_id
    assert coordinator.model("p4", round_id).model == coordinator.model("p1", round_id).model
    assert [d["site_id"] for d in _events(coordinator, "model-read")] == ["p4", "p1"]


def test_a_refused_admin_call_is_recorded(federation: Any, tmp_path: Path) -> None:
    config = replace(load_config(federation.server_dir / "server.toml"), state_dir=tmp_path)
    key = signatures.load_private_key_pem((federation.server_dir / "identity.key").read_bytes())
    admin = AdminRequests(Coordinator(config, Store(tmp_path, federation_id="fed"), key))
    with pytest.raises(NotPermittedError, match="not listed"):
        admin.get("intruder", "run-1")
    assert _events(admin.coordinator, "admin-refused") == [{"admin": "intruder", "rpc": "GetRun"}]
    admin.get("operator", "run-1")
    assert _events(admin.coordinator, "admin-call") == [
        {"admin": "operator", "rpc": "GetRun", "run_id": "run-1"}
    ]
