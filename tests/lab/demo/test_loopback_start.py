"""The loopback harness starts the CKKS decryptor once the coordinator listens (a standing
service in a deployment), so the decryptor's first connection is not refused and its back-off
never holds the sites' uploads back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from afl.lab.demo.federation import LISTENING, await_listening


def _server(log: Path, script: str) -> subprocess.Popen[bytes]:
    handle = log.open("wb")
    try:
        return subprocess.Popen([sys.executable, "-c", script], stdout=handle, stderr=handle)
    finally:
        handle.close()


def test_waits_for_the_listening_line(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    script = (
        "import sys, time\n"
        "print('starting', flush=True)\n"
        "time.sleep(0.3)\n"
        f"print({LISTENING!r} + ' 1234', file=sys.stderr, flush=True)\n"
        "time.sleep(60)\n"
    )
    server = _server(log, script)
    try:
        assert await_listening(server, log, timeout_s=120.0)
        assert LISTENING in log.read_text()
    finally:
        server.kill()
        server.wait()


def test_a_server_that_exits_first_is_not_waited_for(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    server = _server(log, "raise SystemExit(3)")
    assert not await_listening(server, log, timeout_s=120.0)
    assert server.wait() == 3
