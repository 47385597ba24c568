"""The layers stay as docs/design.md draws them: echo/ (pure: no broker, no process) <- streams/ (all
NATS) <- workers/ (processes) <- bench/. No module imports from a layer above its own, even
lazily inside a function; and only streams/ and workers/ speak to NATS."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
FORBIDDEN = {"echo": {"nats", "streams", "workers", "bench"}, "streams": {"workers", "bench"}, "workers": {"bench"}}


def imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_module_imports_from_a_layer_above_its_own(layer):
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files
    wrong = {str(f.relative_to(ROOT)): sorted(imported(f) & FORBIDDEN[layer]) for f in files}
    assert {f: names for f, names in wrong.items() if names} == {}
