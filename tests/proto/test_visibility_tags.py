"""Every field of every .proto carries a visibility tag (docs/protocol.md §12, M-165): the comment
block right above the field (or its trailing comment) holds ``[visible: ...]``, naming who may see
its value (the roles are defined in common.proto; admin.proto adds ``admins``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto" / "afl" / "proto" / "v1"
PROTOS = sorted(PROTO_DIR.glob("*.proto"))
FIELD = re.compile(
    r"^\s*(?:repeated\s+|optional\s+)?(?:map<[^>]+>|[A-Za-z_][\w.]*)\s+\w+\s*=\s*\d+\s*(?:\[[^\]]*\])?;"
)
BLOCK = re.compile(r"^\s*(message|enum|oneof|service)\b")


def untagged_fields(text: str) -> list[str]:
    """The field lines of a .proto text whose comment carries no ``[visible: ...]`` tag (enum
    values are not fields; they are skipped)."""
    missing, comment, blocks = [], [], []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("//"):
            comment.append(stripped)
            continue
        opened = BLOCK.match(line)
        if opened:
            blocks.append(opened.group(1))
        tagged = "[visible:" in " ".join([*comment, line])
        if FIELD.match(line) and (not blocks or blocks[-1] != "enum") and not tagged:
            missing.append(f"{number}: {stripped}")
        blocks = blocks[: len(blocks) - stripped.count("}")] if "}" in stripped else blocks
        comment = []
    return missing


@pytest.mark.parametrize("proto", PROTOS, ids=[p.name for p in PROTOS])
def test_every_field_carries_a_visibility_tag(proto: Path) -> None:
    text = proto.read_text(encoding="utf-8")
    assert any(FIELD.match(line) for line in text.splitlines()), f"{proto.name}: no field found"
    assert untagged_fields(text) == [], f"{proto.name}: fields without a [visible: ...] tag"


def test_the_check_finds_an_untagged_field() -> None:
    text = (
        "message M {\n  // Tagged. [visible: all]\n  string a = 1;\n  // Not tagged.\n"
        "  repeated string b = 2;\n  enum E {\n    E_UNSPECIFIED = 0;\n  }\n  oneof x {\n"
        "    bytes c = 3;  // [visible: server]\n    bytes d = 4;\n  }\n}\n"
    )
    assert untagged_fields(text) == ["5: repeated string b = 2;", "11: bytes d = 4;"]
    assert len(PROTOS) >= 3
