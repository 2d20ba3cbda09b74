"""The converters package imports itself without a cycle (issue 30 item 3: one conversion engine).

Every import counts, at the top of a module or inside a function: a deferred import that closes a
cycle is a cycle all the same (two engines that needed each other did exactly that).
"""

from __future__ import annotations

import ast
from pathlib import Path

import shardkit.converters

PACKAGE = "shardkit.converters"
ROOT = Path(shardkit.converters.__file__).parent


def _module_name(path: Path) -> str:
    return PACKAGE if path.name == "__init__.py" else f"{PACKAGE}.{path.stem}"


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` over every ``.py`` file of ``root``."""
    modules = {_module_name(p): p for p in sorted(root.glob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                # ``from shardkit.converters import parts`` imports a module; ``... import convert`` the package
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_the_converters_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert f"{PACKAGE}.partrun" in graph and graph[f"{PACKAGE}.parts"] >= {f"{PACKAGE}.pipeline"}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_check_sees_a_cycle_closed_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text(f"from {PACKAGE}.b import x\n")
    (tmp_path / "b.py").write_text(f"def f():\n    from {PACKAGE} import a\n    return a\n")
    assert find_cycle(import_graph(tmp_path)) == [f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.a"]
