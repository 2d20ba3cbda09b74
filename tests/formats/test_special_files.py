"""A named pipe in place of a dataset file is refused by name, never waited on (issue 31, item 4).

Opening a FIFO for reading blocks until a writer comes, which used to hang ``verify``, ``sample``
and ``TieredSampler`` forever (holding the reader's lock). Every case runs in a child process with a
timeout, so a regression fails here instead of hanging the test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.datasets import make_records, write_dataset

_TIMEOUT = 120  # seconds: generous for a loaded machine; without the fix the child never ends

#: Every kind of file a reader opens: a payload shard, a field chunk, the array documents, the root.
_FILES = ["image/c/1/0/0/0", "label/c/0", "label/zarr.json", "image/zarr.json", "zarr.json"]


def _with_fifo(tmp_path: Path, rel: str) -> Path:
    ds = write_dataset(tmp_path / "ds", make_records(25), records_per_shard=10)
    target = ds / rel
    assert target.is_file()
    target.unlink()
    os.mkfifo(target)
    return ds


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args}: still blocked after {_TIMEOUT} s (a named pipe was opened as a file)")


def _refused(result: subprocess.CompletedProcess[str], ds: Path, rel: str) -> str:
    text = result.stdout + result.stderr
    assert result.returncode != 0, text
    assert "Traceback" not in text
    assert str(ds / rel) in text and "named pipe" in text, text
    return text


@pytest.mark.parametrize("rel", _FILES)
def test_verify_refuses_a_named_pipe(tmp_path: Path, rel: str) -> None:
    ds = _with_fifo(tmp_path, rel)
    _refused(_run(["-m", "shardkit", "verify", str(ds)]), ds, rel)


def test_verify_quick_refuses_a_named_pipe_shard(tmp_path: Path) -> None:
    ds = _with_fifo(tmp_path, _FILES[0])
    _refused(_run(["-m", "shardkit", "verify", "--quick", str(ds)]), ds, _FILES[0])


def test_info_refuses_a_named_pipe_root_document(tmp_path: Path) -> None:
    ds = _with_fifo(tmp_path, "zarr.json")
    _refused(_run(["-m", "shardkit", "info", str(ds)]), ds, "zarr.json")


def test_sample_refuses_a_named_pipe_shard(tmp_path: Path) -> None:
    ds = _with_fifo(tmp_path, _FILES[0])
    _refused(_run(["-m", "shardkit", "sample", str(ds), "--ram-size", "8records", "--batch-size", "4"]), ds, _FILES[0])


def test_tiered_sampler_refuses_a_named_pipe_shard(tmp_path: Path) -> None:
    ds = _with_fifo(tmp_path, _FILES[0])
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    script = textwrap.dedent(f"""
        import sys
        from shardkit.readers import TieredSampler
        from shardkit.errors import UnsafePathError
        try:
            with TieredSampler({str(ds)!r}, tiers="ram,ssd", ram_size="4records", ssd_size="10records",
                               ssd_dir={str(ssd)!r}, batch_size=3, epochs=1, seed=0) as s:
                for batch in s:
                    pass
        except UnsafePathError as exc:
            print(exc)
            sys.exit(3)
    """)
    result = _run(["-c", script])
    assert result.returncode == 3, result.stdout + result.stderr
    _refused(result, ds, _FILES[0])
    assert list(ssd.iterdir()) == []  # nothing of the user's data left behind


def test_the_local_store_refuses_a_named_pipe(tmp_path: Path) -> None:
    """``get``, ``fetch`` and ``head`` of :class:`~shardkit.stores.LocalStore` (merges copy through it)."""
    ds = _with_fifo(tmp_path, _FILES[0])
    script = textwrap.dedent(f"""
        from shardkit.errors import UnsafePathError
        from shardkit.stores import ByteRange, LocalStore
        store = LocalStore({str(ds)!r})
        for call in (lambda: store.get({_FILES[0]!r}), lambda: list(store.fetch([ByteRange({_FILES[0]!r}, 0, 4)])),
                     lambda: store.head({_FILES[0]!r}), lambda: store.copy({_FILES[0]!r}, "copy")):
            try:
                call()
            except UnsafePathError as exc:
                print("refused:", exc)
            else:
                raise SystemExit("not refused")
    """)
    result = _run(["-c", script])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("refused:") == 4 and "named pipe" in result.stdout
    assert not (ds / "copy").exists()
