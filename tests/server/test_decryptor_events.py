"""The CKKS decryptor is woken by round events, not by polling (docs/benchmarks.md §4c): the
coordinator's ``WatchRounds`` stream sends the decryptor-role site the events of every round,
though it takes part in none, and a data site only those of rounds it takes part in."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from afl.ops.provisioning import ProvisionedFederation
from afl.proto.v1 import coordinator_pb2
from afl.server.config import load_config
from afl.server.daemon.main import CoordinatorServer
from tests.helpers.federation import FederationSpec
from tests.server.fakeclient import FakeSite

SITES = ["s1", "s2", "s3"]
FEDERATION = FederationSpec(
    sites=[*SITES, "dec", "bystander"],
    decryptor="dec",
    federation_id="fed-events",
    round_settings={"classes": ["a"], "feature_dim": 4, "aggregation": "ckks"},
)


@pytest.fixture
def server(federation: ProvisionedFederation, tmp_path: Path) -> Iterator[CoordinatorServer]:
    config = load_config(federation.server_dir / "server.toml")
    config = replace(
        config,
        listen="127.0.0.1:0",
        state_dir=tmp_path / "state",
        round=replace(config.round, participants=tuple(SITES), min_participants=3),
    )
    started = CoordinatorServer(config, tick_s=0.05)
    started.start()
    yield started
    started.stop(None)


def _stages(site: FakeSite, until: int) -> list[int]:
    """The stages of the events ``site``'s stream delivers, up to the first ``until``."""
    stream = site.stub.WatchRounds(coordinator_pb2.WatchRequest(), timeout=60)
    stages = []
    for event in stream:
        stages.append(event.status.stage)
        if event.status.stage == until:
            stream.cancel()
            break
    return stages


def test_the_decryptor_receives_every_rounds_events(
    federation: ProvisionedFederation, server: CoordinatorServer
) -> None:
    port = server.port
    sites = {s: FakeSite(s, federation.site_dirs[s], port) for s in [*SITES, "dec", "bystander"]}
    sites["dec"].enroll()
    sites["bystander"].enroll(["a"], 4)
    for s in SITES:
        sites[s].enroll(["a"], 4)
    review = coordinator_pb2.ROUND_STAGE_PLAN_REVIEW
    assert review in _stages(sites["dec"], review)  # in no round, yet told of each
    assert review in _stages(sites["s1"], review)
    bystander = sites["bystander"].stub.WatchRounds(coordinator_pb2.WatchRequest(), timeout=3)
    with pytest.raises(grpc.RpcError) as info:
        next(iter(bystander))  # enrolled, not a participant: told of nothing
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
