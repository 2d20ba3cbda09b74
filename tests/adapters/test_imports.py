"""Optional frameworks: never imported by ``import shardkit``; a missing one names its extra.

Each check runs in a fresh interpreter so modules imported by other tests cannot hide a leak.
"""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_shardkit_imports_no_framework() -> None:
    proc = _run(
        "import sys, shardkit, shardkit.adapters, shardkit.readers\n"
        "leaked = sorted(m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules)\n"
        "assert not leaked, leaked\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_missing_framework_names_the_extra() -> None:
    # sys.modules[name] = None makes "import name" raise ImportError, as if it were not installed.
    proc = _run(
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['tensorflow'] = None\n"
        "from shardkit.errors import MissingExtraError\n"
        "for module, extra in (('torch', 'torch'), ('tf', 'tensorflow')):\n"
        "    try:\n"
        "        __import__('shardkit.adapters.' + module)\n"
        "    except MissingExtraError as exc:\n"
        "        assert isinstance(exc, ImportError)\n"
        "        assert f'pip install \"shardkit[{extra}]\"' in str(exc), str(exc)\n"
        "        print(exc)\n"
        "    else:\n"
        "        raise SystemExit('no error for ' + module)\n"
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.count("pip install") == 2
