"""``shardkit info`` and ``shardkit verify`` from the command line, as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli

run = run_cli


def test_info_text_and_json(small_dataset) -> None:
    path, _ = small_dataset(n=25)
    res = run("info", str(path))
    assert res.returncode == 0, res.stderr
    assert "records      25" in res.stdout and "(4, 3, 3) uint8" in res.stdout and "label: a, b, c" in res.stdout
    data = json.loads(run("info", str(path), "--json").stdout)
    assert data["records"] == 25 and data["shape"] == [4, 3, 3] and data["dtype"] == "uint8"
    assert data["shards"] == 3 and data["kind"] == "test" and data["labels"] == {"label": ["a", "b", "c"]}
    assert data["bytes"] == sum(f.stat().st_size for f in (path / "image").rglob("*") if f.name != "zarr.json"
                                and f.is_file())


def test_verify_ok_and_flipped_byte(small_dataset) -> None:
    path, _ = small_dataset(n=25)
    res = run("verify", str(path))
    assert res.returncode == 0 and "OK, 3 shards" in res.stdout
    shard = path / "image" / "c" / "1" / "0" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[17] ^= 0x04
    shard.write_bytes(bytes(raw))
    res = run("verify", str(path))
    assert res.returncode == 1
    assert "image/c/1/0/0/0 (records 10-19)" in res.stderr and "crc32c" in res.stderr
    assert "Traceback" not in res.stderr
    # --quick reads each index with the end of its shard's records (tail_crc32c, the last 4 KiB): these
    # shards hold 360 bytes of records, all of them checked, so --quick catches the flip too.
    quick = run("verify", "--quick", str(path))
    assert quick.returncode == 1 and "image/c/1/0/0/0" in quick.stderr and "Traceback" not in quick.stderr


@pytest.mark.parametrize("target", ["missing", "file", "empty"])
def test_errors_are_one_line_without_traceback(tmp_path: Path, target: str) -> None:
    p = tmp_path / "x"
    if target == "file":
        p.write_text("hello")
    elif target == "empty":
        p.mkdir()
    for cmd in ("info", "verify"):
        res = run(cmd, str(p))
        assert res.returncode == 1
        assert res.stderr.startswith("error: ") and str(p) in res.stderr
        assert "Traceback" not in res.stderr


def test_usage_error_exit_code() -> None:
    res = run("info")
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_verify_of_a_format_1_0_dataset_says_what_it_cannot_check() -> None:
    golden = Path(__file__).resolve().parents[1] / "formats" / "golden"
    res = run("verify", str(golden / "v1.0-zstd"))
    assert res.returncode == 0, res.stderr
    assert "format 1.0, full" in res.stdout
    assert "note: written by format 1.0: field chunks and array documents carry no checksums" in res.stderr
    res = run("verify", str(golden / "v1.1-zstd"))
    assert res.returncode == 0 and "format 1.1, full" in res.stdout and "note:" not in res.stderr
    assert "(format 1.1, shardkit" in run("info", str(golden / "v1.1-zstd")).stdout
