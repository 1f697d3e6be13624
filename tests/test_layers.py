"""The layer rules of docs/architecture.md §1, checked on every import statement of the source
tree (module level and inside functions): ``core`` and ``crypto`` import nothing of ours but
themselves, the wire mapping (``afl.proto``) builds on them only, a site (``client``) never
imports the coordinator (``server``) nor the reverse, the operator's commands (``ops``) and the
Flower app (``flower``) are imported by ``lab`` only, and the composing package (``lab``) by
nobody."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Source folder of each layer, and the layers it may import (besides itself).
ALLOWED: dict[str, tuple[str, frozenset[str]]] = {
    "core": ("core", frozenset()),
    "crypto": ("crypto", frozenset()),
    "proto": ("proto/afl/proto", frozenset({"core", "crypto"})),
    "client": ("client", frozenset({"core", "crypto", "proto"})),
    "server": ("server", frozenset({"core", "crypto", "proto"})),
    "ops": ("ops", frozenset({"core", "crypto", "proto", "client", "server"})),
    "flower": ("flower", frozenset({"core", "crypto", "proto", "client", "server"})),
    "lab": ("lab", frozenset({"core", "crypto", "proto", "client", "server", "ops", "flower"})),
}
GENERATED = "_pb2"


def _layers_imported(path: Path) -> set[str]:
    """The afl layers (``afl.<layer>``) that ``path`` imports anywhere."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return {n.split(".")[1] for n in names if n.startswith("afl.") and n.count(".") >= 1}


def _sources(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if GENERATED not in p.stem)


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_what_it_may(layer: str) -> None:
    folder, allowed = ALLOWED[layer]
    files = _sources(folder)
    assert files, f"no sources under {folder}"
    breaches = {
        str(path.relative_to(ROOT)): sorted(found)
        for path in files
        if (found := _layers_imported(path) - allowed - {layer})
    }
    assert breaches == {}, f"{layer} may import only {sorted(allowed)}: {breaches}"


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from afl.server.rounds import RoundMachine\n    import afl.lab\n"
    )
    assert _layers_imported(module) == {"server", "lab"}
