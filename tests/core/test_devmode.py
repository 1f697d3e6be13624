"""M-170: ``--insecure`` is refused by every command that takes it unless ``AFL_DEV=1`` is set,
in one line naming the flag, before anything is read or started (the configs given here do not
even exist: the refusal comes first)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from afl.client.cli import main as client_main
from afl.core.devmode import DEV_ENV, insecure_refusal
from afl.lab.cli import main as afl_main
from afl.server.daemon.main import main as server_main

Main = Callable[[Sequence[str] | None], int]


def test_the_refusal_names_the_flag_and_is_lifted_only_by_the_value_1() -> None:
    message = insecure_refusal("afl-server", {})
    assert message is not None and "AFL_DEV=1" in message and "\n" not in message
    assert insecure_refusal("afl-server", {DEV_ENV: "0"}) is not None
    assert insecure_refusal("afl-server", {DEV_ENV: "yes"}) is not None
    assert insecure_refusal("afl-server", {DEV_ENV: "1"}) is None


@pytest.mark.parametrize(
    ("main", "argv", "program"),
    [
        (server_main, ["--config", "CONFIG", "--insecure"], "afl-server"),
        (server_main, ["check", "--config", "CONFIG", "--insecure"], "afl-server check"),
        (client_main, ["run", "--config", "CONFIG", "--insecure"], "afl-client run"),
        (client_main, ["doctor", "--config", "CONFIG", "--insecure"], "afl-client doctor"),
        (client_main, ["status", "--config", "CONFIG", "--insecure"], "afl-client status"),
        (
            client_main,
            ["run-many", "--config", "CONFIG", "--insecure"],
            "afl-client run-many",
        ),
        (afl_main, ["admin", "--config", "CONFIG", "--insecure", "ls"], "afl admin"),
    ],
)
def test_insecure_is_refused_without_the_development_flag(
    main: Main,
    argv: list[str],
    program: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [str(tmp_path / "missing.toml") if a == "CONFIG" else a for a in argv]
    monkeypatch.delenv(DEV_ENV, raising=False)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{program}: error: --insecure") and "AFL_DEV=1" in err
    assert len(err.splitlines()) == 1
    # With the flag the command goes on (and fails on the missing config instead).
    monkeypatch.setenv(DEV_ENV, "1")
    main(args)
    assert "AFL_DEV" not in capsys.readouterr().err
