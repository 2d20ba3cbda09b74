"""The linters run as part of the test suite, so the README's one test command checks them too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


def test_ruff_passes() -> None:
    try:
        import ruff  # noqa: F401  (the dev extra's package; run it with this interpreter, not PATH's)
    except ImportError:
        pytest.fail("ruff is not installed: install the dev extra (pip install -e '.[dev]')")
    result = _run(sys.executable, "-m", "ruff", "check", "shardkit", "tests", "benchmarks", "examples")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_passes() -> None:
    result = _run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_package_is_typed() -> None:
    assert (ROOT / "shardkit" / "py.typed").is_file()


def test_no_script_shadows_a_standard_module() -> None:
    # A script's folder comes first on sys.path, so `benchmarks/profile.py` once made every peer run
    # from benchmarks/ import it instead of the standard `profile` (LitData and MosaicML failed).
    for folder in ("benchmarks", "examples", "tests"):
        shadows = sorted(p.name for p in (ROOT / folder).rglob("*.py") if p.stem in sys.stdlib_module_names)
        assert not shadows, f"{folder}/ has modules named like standard ones: {shadows}"


_IMPORT_EACH = """
import importlib, pkgutil, sys
import shardkit
# The layers the others build on (the ones an upward import can tie into a cycle); the whole package
# would take a minute of the suite.
layers = ("formats", "order", "stores", "tiers", "readers")
names = sorted(m.name for m in pkgutil.walk_packages(shardkit.__path__, "shardkit.")
               if m.name.split(".")[1] in layers)
failed = []
for name in names:
    for loaded in [k for k in sys.modules if k == "shardkit" or k.startswith("shardkit.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ImportError as e:  # an optional extra's module reports itself; a cycle is an ImportError too
        if "circular import" in str(e) or "partially initialized" in str(e):
            failed.append(f"{name}: {e}")
print("\\n".join(failed))
"""


def test_every_lower_layer_module_imports_first_without_a_cycle() -> None:
    # A module imported first in a fresh process (a spawned worker, a benchmark) must not hit an import
    # cycle that the usual order (`import shardkit` first) hides.
    result = _run(sys.executable, "-c", _IMPORT_EACH)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", result.stdout
