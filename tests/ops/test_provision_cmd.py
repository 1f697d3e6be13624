"""`afl provision` front end (ops/provision.py), run through its own argparse parser."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from afl.ops import provision as provision_cmd


def test_cli_entry_points(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    provision_cmd.add_arguments(parser)
    argv = ["--out", str(tmp_path / "f"), "--site", "h1", "--site", "h2"]
    argv += ["--server-host", "afl.example.org", "--port", "6000"]
    assert provision_cmd.run(parser.parse_args(argv)) == 0
    cfg = tomllib.loads((tmp_path / "f" / "sites" / "h2" / "client.toml").read_text())
    assert cfg["client"]["server"] == "afl.example.org:6000"
    assert "h1" in capsys.readouterr().out
    assert provision_cmd.run(parser.parse_args(argv)) == 2  # existing federation
    assert "already holds a federation" in capsys.readouterr().err


def test_cli_reports_bad_site_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    provision_cmd.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "f"), "--site", "Bad Id"])
    assert provision_cmd.run(args) == 2
    assert "invalid site id" in capsys.readouterr().err
    assert not (tmp_path / "f" / "ca.key").exists()
