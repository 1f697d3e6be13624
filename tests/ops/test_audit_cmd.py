"""Tests of the `afl audit` front end (run through its own argparse parser)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from afl.ops import audit as audit_cmd


def run_audit(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    audit_cmd.add_arguments(parser)
    rc = audit_cmd.run(parser.parse_args(list(argv)))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def missing7(tmp_path: Path) -> Path:
    spec = {"sites": list(range(8)), "classes": {f"class{i}": [i] for i in range(8)}}
    path = tmp_path / "missing7.json"
    path.write_text(json.dumps(spec))
    return path


def test_per_class_missing7_fails(capsys, missing7: Path) -> None:
    rc, out, _ = run_audit(capsys, "--coverage", str(missing7), "--gram-scope", "per-class")
    assert rc == 1
    assert "Verdict: FAIL" in out
    assert "Sites exposed individually (per quantity): 16" in out


def test_global_missing7_passes(capsys, missing7: Path) -> None:
    rc, out, _ = run_audit(capsys, "--coverage", str(missing7))
    assert rc == 0
    assert "Verdict: PASS" in out


def test_json_output(capsys, missing7: Path) -> None:
    rc, out, _ = run_audit(
        capsys, "--coverage", str(missing7), "--gram-scope", "per-class", "--json"
    )
    doc = json.loads(out)
    assert rc == 1 and doc["passed"] is False
    grams = [e for e in doc["exposed_sites"] if e["quantity"] == "gram"]
    assert sorted(e["sites"][0] for e in grams) == list(range(8))
    assert grams[0]["certificate"] == {"gram{0}": "1"}


def test_simulate_labels_format_is_accepted(capsys, tmp_path: Path) -> None:
    # Site c labels every class but c: per-class sums expose each site (K = 3, docs/protocol.md
    # §6).
    sites = ["a", "b", "c"]
    spec = {
        "classes": ["x", "y", "z"],
        "sites": sites,
        "labels": {"a": ["y", "z"], "b": ["x", "z"], "c": ["x", "y"]},
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    rc, out, _ = run_audit(capsys, "--coverage", str(path), "--gram-scope", "per-class", "--json")
    doc = json.loads(out)
    assert rc == 1
    assert sorted(e["sites"][0] for e in doc["exposed_sites"] if e["quantity"] == "gram") == sites


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({"sites": [0, 1]}),
        json.dumps({"sites": [0, 1], "classes": {"a": [5]}}),
        json.dumps({"sites": [0, 1], "classes": {"a": []}}),
        json.dumps({"sites": [0, 0], "classes": {"a": [0]}}),
    ],
)
def test_invalid_spec_exits_2(capsys, tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    rc, out, err = run_audit(capsys, "--coverage", str(path))
    assert rc == 2
    assert err.startswith("afl audit:")
    assert out == ""
