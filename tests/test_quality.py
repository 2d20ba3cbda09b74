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
