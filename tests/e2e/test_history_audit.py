"""The coordinator audits every training plan with everything the federation already released
(docs/protocol.md §6, M-124), through the real daemons and an honest operator:

* a run over four of the five sites of a published run would give the fifth site's statistics
  as the difference of the two sums: ``afl admin submit`` is refused with one line naming
  site-5, exits non-zero, and no run, round or upload of it exists;
* a run over all five in which one site drops out after ShareKeys would unmask the same
  difference over the survivors: refused before anything is unmasked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from afl.core.aggregation import federated_solve
from afl.proto.v1 import admin_pb2 as apb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.store import Store
from tests.e2e import vanishing_client
from tests.e2e.faults.harness import federation
from tests.e2e.loopback import cached_statistics
from tests.e2e.processes import Daemons, admin_command
from tests.helpers.numeric import relative_error

FOUR = ["site-1", "site-2", "site-3", "site-4"]
#: Run 2 plans four sites: the audit, not the participant count, must be what refuses it.
SETTINGS = {"min_participants": 3}


def _federation(root: Path) -> Any:
    return federation(root, "mask", sites=5, serve=True, round_settings=SETTINGS)


def _released_rounds(loop: Any, run_id: str) -> tuple[list[str], int]:
    """The rounds of ``run_id`` and how many uploads the coordinator stored for them."""
    store = Store(loop.server_config.parent / "state", federation_id=loop.provisioned.federation_id)
    rounds = [r.round_id for r in store.rounds(run_id)]
    return rounds, sum(len(store.uploads(r)) for r in rounds)


def test_runs_that_difference_to_one_site_are_refused_before_anything_is_released(
    tmp_path: Path,
) -> None:
    loop = _federation(tmp_path)
    daemons = Daemons(loop)
    try:
        daemons.start_server()
        daemons.start_clients()
        first = daemons.wait_run("run-1")
        assert first.state == "published", daemons.log_tail()

        # Attack 1: site-5 leaves, the operator re-trains over the other four: refused at
        # submission, with one line and a non-zero exit.
        four = tmp_path / "four.toml"
        four.write_text("[round]\nparticipants = [" + ", ".join(f'"{s}"' for s in FOUR) + "]\n")
        refused = admin_command(loop, "submit", str(four), "--name", "without site-5")
        assert refused.returncode != 0 and refused.stdout == "", refused
        assert "Traceback" not in refused.stderr and refused.stderr.count("\n") == 1, refused
        line = refused.stderr.strip()
        assert line.startswith("afl admin: FAILED_PRECONDITION: run 'without site-5' is refused")
        assert "statistics of site-5" in line and "M-124" in line, line
        assert "/gram[all]" in line and "keep those sites in the run" in line, line
        runs = daemons.call(daemons.admin.ListRuns, apb.ListRunsRequest()).runs
        assert [(r.run_id, len(r.round_history)) for r in runs] == [
            ("run-1", len(first.round_history))
        ]

        # Attack 3: site-5 takes part and vanishes after ShareKeys; the survivors' sums would
        # be run 1's minus site-5.
        daemons.clients["site-5"].terminate()
        daemons.clients["site-5"].wait(timeout=60)
        config = loop.client_configs["site-5"]
        argv = [*vanishing_client.command("share-keys"), "run", "--config", str(config)]
        daemons.clients["site-5"] = daemons._spawn(
            "site-5-vanishing", [*argv, "--log-level", "INFO"]
        )
        # Each stage waits its deadline for site-5 once it is gone; the four others answer each
        # stage within seconds even on a loaded machine.
        daemons.submit("[round]\nupload_timeout_s = 30.0\n", name="site-5 drops out")
        second = daemons.wait_run("run-2")
        assert second.state == "aborted", second
        assert "before unmasking" in second.reason and "site-5" in second.reason, second.reason
        assert daemons.clients["site-5"].wait(timeout=120) == vanishing_client.EXIT_CODE
    finally:
        daemons.stop()

    # The refused submission left no run, round or upload; run 2's masked inputs reached the
    # coordinator, but no sum was formed and no model exists.
    store = Store(loop.server_config.parent / "state", federation_id=loop.provisioned.federation_id)
    assert [(r.run_id, r.name) for r in store.runs()] == [
        ("run-1", "initial"),
        ("run-2", "site-5 drops out"),
    ]
    assert {r.run_id for r in store.rounds()} == {"run-1", "run-2"}
    assert all(store.model(r) is None for r in _released_rounds(loop, "run-2")[0])
    records = [
        (e, json.loads(d)) for _, _, e, d, *_ in store.audit_records(after_seq=0, limit=10_000)
    ]
    [submit_refused] = [d for e, d in records if e == "run-submit-refused"]
    assert submit_refused["exposed"] == ["site-5"] and submit_refused["members"] == FOUR
    assert [e for e, _ in records].count("plan-audit-history") == 1  # run 2, before unmasking

    # Run 1's model is the five sites' (the oracle: a plaintext solve of their statistics).
    stats, _ = cached_statistics(loop, list(loop.site_ids))
    w_ref, _ = federated_solve(stats, gamma=1.0, gram_scope="global")
    model = store.model(_released_rounds(loop, "run-1")[0][-1])
    assert model is not None
    published = pb.Model.FromString(model[1])
    assert sorted(published.contributors) == sorted(loop.site_ids)
    w = np.frombuffer(published.weights.data, dtype="<f8").reshape(w_ref.shape)
    assert relative_error(w, w_ref) <= 1e-9
