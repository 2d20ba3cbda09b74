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


def test_a_reading_worker_imports_no_conversion_or_serving_code() -> None:
    """A spawned DataLoader worker imports the adapter afresh: it must not pull in the conversion
    engine, the server or codecs it never uses (issue 32: seconds of worker start-up)."""
    proc = _run(
        "import sys, shardkit.adapters.torch\n"
        "heavy = ('shardkit.converters', 'shardkit.serve', 'shardkit.viz', 'shardkit.cli', 'zarr', 'numcodecs',\n"
        "         'obstore', 'PIL', 'dask', 'matplotlib')\n"
        "leaked = sorted(m for m in sys.modules if m in heavy or m.startswith(tuple(h + '.' for h in heavy)))\n"
        "assert not leaked, leaked\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_lazily_imported_names_still_resolve() -> None:
    """What the lazy imports defer is still there on first use, as the same objects."""
    proc = _run(
        "import sys, shardkit, shardkit.readers\n"
        "assert 'shardkit.converters' not in sys.modules and 'shardkit.serve' not in sys.modules\n"
        "from shardkit.converters import convert\n"
        "from shardkit.converters.merging import merge\n"
        "from shardkit.serve import SharedSampler, TierServer, serve\n"
        "assert shardkit.convert is convert and shardkit.merge is merge\n"
        "assert (shardkit.readers.SharedSampler, shardkit.readers.TierServer, shardkit.readers.serve) == "
        "(SharedSampler, TierServer, serve)\n"
        "from shardkit.readers import SharedSampler as again\n"
        "assert again is SharedSampler\n"
        "try:\n"
        "    shardkit.readers.no_such_name\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_preload_covers_the_first_unique() -> None:
    """A forked worker's first pass imports nothing that :data:`PRELOAD` left out: numpy's ``unique``
    (the download's order, the first block's plan) imports ``numpy.ma`` on its first call."""
    proc = _run(
        "import sys, numpy as np\n"
        "from shardkit.adapters import _start\n"
        "_start.preload()\n"
        "before = set(sys.modules)\n"
        "np.unique(np.array([3, 1, 3]))\n"
        "new = sorted(set(sys.modules) - before)\n"
        "assert not new, new\n"
    )
    assert proc.returncode == 0, proc.stderr
