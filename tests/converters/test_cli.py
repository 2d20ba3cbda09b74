"""``shardkit convert``: progress, summary, --strict exit code naming the file, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.formats import open_dataset
from tests.helpers.corpora import make_imagefolder

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardkit.cli.main", "convert", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("cli") / "corpus"
    return root, make_imagefolder(root, per_class=3)


def test_convert_prints_summary_and_progress(corpus, tmp_path: Path) -> None:
    root, expected = corpus
    r = _cli(str(root), "-o", str(tmp_path / "out"), "--size", "16x24", "--workers", "2",
             "--shard-size", "4KiB", "--compression", "zstd")
    assert r.returncode == 0, r.stderr
    assert "wrote        9 records" in r.stdout and f"skipped      {len(expected)}" in r.stdout
    assert "records/s" in r.stdout and "bytes" in r.stdout
    assert "img/s" in r.stderr or "it/s" in r.stderr  # tqdm rate
    assert "Traceback" not in r.stderr
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.record.shape == (16, 24, 3) and ds.meta.compression["name"] == "zstd"
        assert len(ds.meta.shards) > 1


def test_strict_exits_nonzero_naming_the_file(corpus, tmp_path: Path) -> None:
    root, expected = corpus
    r = _cli(str(root), "-o", str(tmp_path / "out"), "--size", "16", "--strict", "-q")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--strict" in lines[0]
    assert str(root / "train" / "dog" / sorted(expected)[0]) in lines[0]


def test_errors_are_one_line_without_traceback(corpus, tmp_path: Path) -> None:
    root, _ = corpus
    out = tmp_path / "out"
    assert _cli(str(root), "-o", str(out), "--size", "16", "-q").returncode == 0
    cases = [
        ([str(root), "-o", str(out), "--size", "20", "-q"], "different parameters"),
        ([str(tmp_path / "nowhere"), "-o", str(tmp_path / "o2")], "not found"),
        ([str(root), "-o", str(tmp_path / "o3"), "--size", "abc"], "--size"),
        ([str(root), "-o", str(tmp_path / "o4"), "--kind", "audio"], "no input could be converted"),
        ([str(root), "-o", str(tmp_path / "o5"), "--sample-rate", "8000"], "does not accept"),
        ([str(root), "-o", str(tmp_path / "o6"), "--shard-size", "lots"], "--shard-size"),
    ]
    for args, needle in cases:
        r = _cli(*args)
        assert r.returncode == 1, (args, r.stderr)
        assert "Traceback" not in r.stderr and needle in r.stderr, (args, r.stderr)
    r = _cli(str(root), "-o", str(out), "--size", "20", "--overwrite", "-q")
    assert r.returncode == 0, r.stderr
    r = _cli(str(root), "-o", str(out), "--size", "20", "-q")
    assert r.returncode == 0 and "nothing to do" in r.stdout
