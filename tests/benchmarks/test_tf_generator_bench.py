"""benchmarks/tf_generator.py's device prime: the plain read it makes before each host-warm pass
reads every byte of the dataset's files (so the host's cache holds all of them), and says its rate."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.benchmarks import load_benchmark


def test_plain_read_reads_every_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("tf_generator", monkeypatch)
    sizes = {"a/c/0": 9 << 20, "a/c/1": 3, "b/zarr.json": 100}  # one file over a read's 8 MiB
    for name, size in sizes.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    read: list[int] = []
    real_open = open

    def counting_open(file: Path, mode: str = "r", buffering: int = -1) -> object:
        fh = real_open(file, mode, buffering)
        inner_read = fh.read

        def counted(n: int = -1) -> bytes:
            chunk = inner_read(n)
            read.append(len(chunk))
            return chunk

        fh.read = counted  # type: ignore[method-assign]
        return fh

    monkeypatch.setattr(bench, "open", counting_open, raising=False)
    assert bench.plain_read(tmp_path) > 0
    assert sum(read) == sum(sizes.values())
