"""The layering of docs/architecture.md, read from the source: every import (function-level ones included) points to
the same part or a part below, no module imports another's private name, and no part imports Lightning where the
architecture says plain torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "lit_memtrain"
# Top first: a part may import the parts after it (and itself), never one before it.
LAYERS = ("cli", "planner", "callbacks", "strategies", "objectives", "parallel", "techniques", "models", "datamodules")
PLAIN_TORCH = ("parallel", "techniques", "models")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import statement in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
    return found


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_belongs_to_a_part_but_the_public_api_and_the_moved_paths():
    loose = {_module_name(path) for path in SOURCES if _part(_module_name(path)) is None}
    assert loose == {"lit_memtrain", "lit_memtrain.moved"}


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: _module_name(path))
def test_imports_point_down_the_layers_and_take_no_private_names(path):
    importer = _module_name(path)
    own = _part(importer)
    problems = []
    for module, names, line in _imports(path):
        if not module.startswith("lit_memtrain"):
            if own in PLAIN_TORCH and module.split(".")[0] in ("lightning", "pytorch_lightning"):
                problems.append(f"line {line}: {own}/ is plain torch but imports {module}")
            continue
        private = [name for name in names if name.startswith("_") and not name.startswith("__")]
        if private and module != importer:
            problems.append(f"line {line}: imports private {private} of {module}")
        target = _part(module)
        if own is None or target is None:  # the public API imports from everywhere; moved.py imports nothing
            continue
        if LAYERS.index(target) < LAYERS.index(own):
            problems.append(f"line {line}: {own}/ imports {module}, a layer above it")
    assert not problems, f"{importer}:\n" + "\n".join(problems)


def test_no_import_circles_between_modules():
    graph = {
        _module_name(path): {
            module for module, _, _ in _imports(path) if module.startswith("lit_memtrain.") and module != "lit_memtrain"
        }
        for path in SOURCES
    }
    circles = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in stack:
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in done:
                visit(nxt, [*stack, nxt], done)
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            visit(start, [start], done)
    assert not circles, "\n".join(circles)
