"""`afl ca` (ops/ca.py; docs/operations.md §2, M-73): the operator's commands of production
provisioning through `afl`'s own parser, the CA passphrase sources, and one-line errors."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from afl.client.cli import main as client_main
from afl.lab.cli import build_parser
from afl.lab.cli import main as afl_main


def _one_line_error(capsys: pytest.CaptureFixture[str], text: str) -> None:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and text in err and "Traceback" not in err, err


def test_production_commands_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AFL_CA_PASS", "correct horse battery")
    ca, out = str(tmp_path / "ca"), str(tmp_path / "out")
    init = ["ca", "init", "--out", ca, "--federation-id", "fed-c"]
    assert afl_main([*init, "--passphrase-env", "AFL_CA_PASS"]) == 0
    assert b"ENCRYPTED PRIVATE KEY" in (tmp_path / "ca" / "ca.key").read_bytes()
    server_kit = tmp_path / "server"
    argv = ["ca", "server-init", "--kit", str(server_kit), "--host", "afl.example.org"]
    assert afl_main([*argv, "--port", "6002"]) == 0
    assert client_main(["init", "--kit", str(tmp_path / "h1"), "--site-id", "h1"]) == 0
    capsys.readouterr()
    requests = [str(server_kit / "server.request.json"), str(tmp_path / "h1" / "h1.request.json")]
    sign = ["ca", "sign", "--ca", ca, "--out", out, *requests]
    assert afl_main([*sign, "--passphrase-env", "AFL_CA_PASS"]) == 0
    printed = capsys.readouterr().out
    roster = (tmp_path / "out" / "roster.json").read_text()
    fingerprint = roster.split('"fingerprint": "')[1].split('"')[0]
    assert f"roster fingerprint: {fingerprint}" in printed
    server_toml = tomllib.loads((tmp_path / "out" / "server" / "server.toml").read_text())
    assert server_toml["server"]["federation_id"] == "fed-c"
    argv = ["init", "--kit", str(tmp_path / "h1"), "--import", str(tmp_path / "out/sites/h1")]
    assert client_main([*argv, "--roster-fingerprint", fingerprint]) == 0


def test_wrong_or_missing_passphrase_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "pass.txt"
    secret.write_text("right\n")
    ca = str(tmp_path / "ca")
    assert afl_main(["ca", "init", "--out", ca, "--passphrase-file", str(secret)]) == 0
    capsys.readouterr()
    # stdin is not a terminal under pytest: no prompt, a clear error.
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert afl_main(["ca", "init", "--out", str(tmp_path / "ca2")]) == 2
    _one_line_error(capsys, "--passphrase-file FILE or --passphrase-env VAR (or --no-passphrase)")
    server = tmp_path / "server"
    assert afl_main(["ca", "server-init", "--kit", str(server), "--host", "localhost"]) == 0
    sign = ["ca", "sign", "--ca", ca, "--out", str(tmp_path / "out")]
    sign.append(str(server / "server.request.json"))
    capsys.readouterr()
    assert afl_main(sign) == 2
    _one_line_error(capsys, "the CA key needs a passphrase")
    secret.write_text("wrong\n")
    assert afl_main([*sign, "--passphrase-file", str(secret)]) == 2
    _one_line_error(capsys, "wrong passphrase")
    monkeypatch.setenv("EMPTY_PASS", "")
    assert afl_main([*sign, "--passphrase-env", "EMPTY_PASS"]) == 2
    _one_line_error(capsys, "is empty")
    assert not (tmp_path / "out").exists()


def test_all_in_one_provision_says_it_is_for_demos_and_tests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert "DEMO/TESTS ONLY" in build_parser().format_help()
    with pytest.raises(SystemExit):
        afl_main(["provision", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "generated HERE" in text and "afl-client init" in text
