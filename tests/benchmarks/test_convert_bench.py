"""benchmarks/convert.py's paired rounds: one pass of ``_convert_pass.py`` finds every stage it splits the
CPU into (a renamed function would silently drop a column), and the CPU-bound speed-up it derives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers.benchmarks import BENCHMARKS, load_benchmark

REPO = Path(__file__).resolve().parents[2]


def _jpegs(src: Path, n: int, shape: tuple[int, int, int]) -> Path:
    """``n`` random JPEGs of ``shape`` in two class folders under ``src``."""
    rng = np.random.default_rng(0)
    for i in range(n):
        (src / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)).save(src / f"c{i % 2}" / f"{i}.jpg")
    return src


def test_pass_splits_a_two_worker_conversion_by_stage(tmp_path: Path) -> None:
    src = _jpegs(tmp_path / "src", 12, (60, 80, 3))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "_convert_pass.py"), "w2", str(src), str(tmp_path / "out"),
                           "--warmup", "4"], capture_output=True, text=True, env=env, timeout=600, check=True)
    res = json.loads(proc.stdout.splitlines()[-1])
    assert res["missing"] == [] and res["tree"] == str(REPO) and res["images"] == 12
    stages = res["stages"]
    # Counted after the warm-up only; the decodes ran in the forked workers, whose sums came back.
    assert stages["decode"]["calls"] == 12 and stages["decode"]["worker"] > 0 and stages["decode"]["main"] == 0
    assert stages["task"]["worker"] >= stages["decode"]["worker"] + stages["resize"]["worker"]
    assert res["write"] > 0 and res["commit"] > 0 and res["commit_wall"] > 0 and res["last_close_wall"] > 0
    assert not (tmp_path / "out").exists()


def test_the_bare_loop_on_two_processes_decodes_every_image_in_its_children(tmp_path: Path) -> None:
    """``bare2``, the machine's ceiling for ``w2 / w1``: both halves run in child processes (their CPU
    counted as children's, the parent's only the start) and every image is decoded."""
    src = _jpegs(tmp_path / "src", 40, (300, 400, 3))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "_convert_pass.py"), "bare2", str(src), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=600, check=True)
    res = json.loads(proc.stdout.splitlines()[-1])
    assert res["images"] == 40 and res["children"] > 0 and res["children"] > res["own"]


def test_cpu_bound_time_of_one_and_two_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("_convert_pass", monkeypatch)
    one = {"decode": 2.0, "resize": 2.0, "task other": 0.0, "worker IPC": 0.0, "client": 0.5, "write": 0.5,
           "commit": 0.1, "total": 5.1}
    # One worker: the loop (decode, resize, client) beside the writer thread, then the commit.
    assert bench.cpu_bound_time(one, 1) == pytest.approx(4.5 + 0.1)
    two = {**one, "task other": 0.2, "worker IPC": 0.2, "client": 0.3, "total": 5.5}
    # Two workers: both cores busy with everything but the commit.
    assert bench.cpu_bound_time(two, 2) == pytest.approx((5.5 - 0.1) / 2 + 0.1)
    # A parent loop slower than half the work bounds it instead.
    assert bench.cpu_bound_time({**two, "client": 6.0, "total": 11.0}, 2) == pytest.approx(6.0 + 0.1)
