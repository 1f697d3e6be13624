"""Attack 5 of issue 23 through the real daemons (docs/protocol.md M-196, M-197, docs/operations.md
§13.2): a site whose `dp-ledger/` is deleted after a DP run refuses to start in one line naming
the recovery command; `afl-client budget --rebuild-from-log` rebuilds the ledger byte for byte from
the site's signed statements in the federation log (under a checkpoint a quorum cosigned), after
which the site starts and `afl-client budget` shows the earlier release."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from afl.client.config import load_client_config
from afl.client.connectivity import connect
from afl.client.daemon.rpc import CoordinatorClient
from afl.client.daemon.transparency import LogWitness
from afl.client.daemon.transport import retry_policy
from afl.client.policy.ledger import DpLedger
from afl.crypto.identity.signatures import load_private_key_pem
from afl.lab.demo.federation import CLIENT_COMMAND
from afl.proto.v1 import coordinator_pb2_grpc as pb_grpc
from tests.e2e.dp_scenario import dp_federation
from tests.e2e.faults.harness import site_state
from tests.e2e.processes import Daemons

pytestmark = pytest.mark.slow

CLIENT = list(CLIENT_COMMAND)


def _budget(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLIENT, "budget", "--config", str(config), *extra],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def _witness(config_path: Path) -> None:
    """What a running site does while it waits for a round: cosign the newest checkpoint."""
    config = load_client_config(config_path)
    key = load_private_key_pem(config.identity_key_path.read_bytes())
    with connect(config) as channel:
        rpc = CoordinatorClient(
            pb_grpc.CoordinatorStub(channel), site_id=config.site_id, timing=config.timing,
            retry=retry_policy(config.timing),
        )  # fmt: skip
        LogWitness.for_site(config, key).witness(rpc.call)


def test_a_deleted_ledger_is_refused_and_rebuilt_from_the_log(tmp_path: Path) -> None:
    loop = dp_federation(tmp_path, 3, round_settings={"min_participants": 3})
    daemons = Daemons(loop)
    site, config = "site-1", loop.client_configs["site-1"]
    try:
        daemons.start_server()
        daemons.start_clients()
        for name, proc in daemons.clients.items():
            assert proc.wait(timeout=400) == 0, (name, daemons.log_tail())
        ledger = DpLedger(site_state(loop, site) / "dp-ledger")
        before = {p.name: p.read_bytes() for p in ledger.root.glob("*.json")}
        assert len(before) == 1

        shutil.rmtree(ledger.root)  # attack 5: a fresh lifetime budget
        daemons.start_client(site)
        assert daemons.clients[site].wait(timeout=300) == 1, daemons.log_tail()
        text = (daemons.logs / f"{site}.log").read_text(errors="replace")
        line = next(x for x in text.splitlines() if "afl-client run: error:" in x)
        assert "the DP ledger is missing: the federation log holds 1 release(s)" in line
        assert "afl-client budget --rebuild-from-log --config" in line
        assert not ledger.root.exists() or not any(ledger.root.iterdir())

        _witness(loop.client_configs["site-2"])  # a second roster site: the quorum of 2
        rebuilt = _budget(config, "--rebuild-from-log")
        assert rebuilt.returncode == 0, rebuilt.stderr
        assert "rebuilt from the federation log: 1 entry" in rebuilt.stdout
        assert {p.name: p.read_bytes() for p in ledger.root.glob("*.json")} == before
        shown = _budget(config)
        assert shown.returncode == 0 and "over 1 release(s)" in shown.stdout, shown.stdout

        daemons.start_client(site)  # accepted now
        assert daemons.clients[site].wait(timeout=300) == 0, daemons.log_tail()
    finally:
        daemons.stop()
