"""One kind of source: no reader branches on whether it reads a dataset or a mixture (issue 30)."""

from __future__ import annotations

import ast
from pathlib import Path

import shardkit

#: Classes that are kinds of source: a reader that asks "is this one?" branches on the source's kind.
SOURCE_TYPES = {"Mixture", "MixedDataset", "MixedPayload", "MixedIdentity", "Dataset", "DatasetIdentity"}


def _names(node: ast.expr) -> set[str]:
    """The class names an isinstance's second argument mentions (a name, an attribute, a tuple)."""
    if isinstance(node, ast.Tuple):
        return set().union(*(_names(e) for e in node.elts))
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.BinOp):  # A | B
        return _names(node.left) | _names(node.right)
    return set()


def source_kind_checks(root: Path) -> list[str]:
    """``file:line`` of every isinstance/issubclass whose class argument is a source type."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
                    and _names(node.args[1]) & SOURCE_TYPES):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_no_isinstance_on_the_kind_of_source() -> None:
    assert source_kind_checks(Path(shardkit.__file__).parent) == []


def test_the_scan_finds_a_source_kind_check(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f(x):\n    return isinstance(x, (int, sources.Mixture))\n"
                              "def g(x):\n    return isinstance(x, str)\n")
    assert source_kind_checks(pkg) == ["pkg/m.py:2"]
