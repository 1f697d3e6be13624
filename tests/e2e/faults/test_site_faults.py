"""A site and the CKKS decryptor killed (SIGKILL) at their most fragile moment and restarted: the
run publishes the model of every site, W equal to the independent solve (docs/operations.md §8:
"afl-client killed", "the decryptor killed")."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.faults.harness import assert_every_site_in_the_model, federation
from tests.e2e.processes import Daemons

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("mode", "victim", "point"),
    [("plaintext", "site-1", "after-upload"), ("ckks", "decryptor", "after-decrypt-record")],
)
def test_a_killed_site_or_decryptor_restarts_and_the_run_has_every_site(
    tmp_path: Path, mode: str, victim: str, point: str
) -> None:
    loop = federation(tmp_path, mode)
    daemons = Daemons(loop)
    try:
        daemons.start_server()
        daemons.start_clients(crash_at={victim: point})
        try:
            code = daemons.clients[victim].wait(timeout=400)
        except Exception as exc:
            raise AssertionError(f"{victim} was not killed\n{daemons.log_tail()}") from exc
        assert code == -9, (victim, code, daemons.log_tail())
        daemons.start_client(victim)
        assert_every_site_in_the_model(daemons, "run-1")
        for site in loop.site_ids:  # the decryptor serves until it is stopped
            assert daemons.clients[site].wait(timeout=300) == 0, (site, daemons.log_tail())
    finally:
        daemons.stop()
