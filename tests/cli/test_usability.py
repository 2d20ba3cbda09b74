"""Issue 14, items 5 to 7 as a user meets them: sizes that say the record size, one unit system (IEC)
in every command, shards described plainly, a warning for the wrong kind, the README's torch example
silent on a CPU-only machine, a readable demo."""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.readers import SharedSampler
from shardkit.serve import wait_for_server
from tests.helpers.cli import run_cli
from tests.helpers.corpora import natural_image, save_jpeg
from tests.helpers.sampler_data import make_dataset

REPO = Path(__file__).resolve().parents[2]
DATASETS = REPO / "datasets"


run = run_cli


def test_ram_budget_below_one_record_says_the_record_size(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 10)  # records of 16 bytes
    r = run("sample", str(ds), "--ram-size", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = r.stderr.strip()
    assert line.startswith("error: --ram-size: ") and "16 bytes" in line and "\n" not in line


def test_info_describes_shards_by_count_records_and_capacity(small_dataset) -> None:
    path, _ = small_dataset(n=25, records_per_shard=10)
    assert "shards       3 shards, 25 records (capacity 10 per shard), " in run("info", str(path)).stdout
    path, _ = small_dataset(n=1, records_per_shard=4)
    assert "shards       1 shard, 1 record (capacity 4 per shard), " in run("info", str(path)).stdout


_SI = re.compile(r"\d(?: )?(?:kB|KB|MB|GB|TB)\b")


def test_every_command_prints_sizes_in_iec_units(tmp_path: Path) -> None:
    out = tmp_path / "coco"
    outputs = [run("convert", str(DATASETS / "coco"), "-o", str(out), "--size", "64", "-q").stdout,
               run("info", str(out)).stdout, run("verify", str(out)).stdout,
               run("sample", str(out), "--ram-size", "4records", "--batch-size", "4").stdout]
    assert "KiB checksummed" in outputs[2] and "OK, 1 shard and " in outputs[2]
    for text in outputs:
        assert "iB" in text and not _SI.search(text), text


def test_serve_summary_in_iec_units(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 12)
    name = f"u{os.getpid()}-{secrets.token_hex(3)}"
    p = subprocess.Popen([sys.executable, "-m", "shardkit.cli.main", "serve", str(ds), "--name", name, "--epochs", "1",
                          "--ram-size", "6records"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_for_server(name, timeout=60)
        with SharedSampler(name, job_seed=0, batch_size=4) as job:
            assert sum(len(b["key"]) for b in job) == 12
        stdout, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=30)
    assert p.returncode == 0, stderr
    assert re.search(r"disk \d+(\.\d)? (B|KiB) read in \d+ calls", stdout) and not _SI.search(stdout), stdout


def test_class_folders_without_images_warn_and_name_the_kind(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A COCO root (annotations/ + images/val2017/) converted as class folders: 'annotations' would be
    # a class without records.
    root = tmp_path / "cocoroot"
    shutil.copytree(DATASETS / "coco" / "val", root / "images" / "val2017")
    (root / "annotations").mkdir()
    shutil.copy(DATASETS / "coco" / "annotations" / "instances_val.json", root / "annotations" / "instances_val2017.json")
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        s = shardkit.convert(root, tmp_path / "out", kind="imagefolder", size=16, workers=1)
    assert s.records == 20
    lines = [r.getMessage() for r in caplog.records if "class folders hold no image files" in r.getMessage()]
    assert len(lines) == 1
    assert "annotations/ (1 other file)" in lines[0] and "looks like a coco corpus: pass kind='coco'" in lines[0]
    r = run("convert", str(root), "--kind", "imagefolder", "-o", str(tmp_path / "cli"), "--size", "16", "-q")
    assert r.returncode == 0 and "pass --kind coco" in r.stderr
    # A class folder that does hold images, or that this split lacks, is no reason to warn.
    caplog.clear()
    for c in ("a", "b"):
        save_jpeg(tmp_path / "ok" / "train" / c / "x.jpg", natural_image(20, 20, 0))
    save_jpeg(tmp_path / "ok" / "val" / "a" / "y.jpg", natural_image(20, 20, 1))
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        shardkit.convert(tmp_path / "ok", tmp_path / "o2", split="val", size=16, workers=1)
    assert not [r for r in caplog.records if "class folders" in r.getMessage()]


def test_readme_torch_loader_is_silent_on_a_cpu_only_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")  # the torch extra
    import shardkit.adapters.torch as adapter

    ds = make_dataset(tmp_path / "ds", 12)
    assert not torch.cuda.is_available() and not adapter.accelerator_present()
    data = adapter.ShardIterableDataset(ds, batch_size=4, seed=0, layout="NCHW", scale="float", drop_last=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = data.loader(num_workers=0)  # as in the README
        keys = np.concatenate([b["key"].numpy() for b in loader])
    assert sorted(keys.tolist()) == list(range(12)) and loader.pin_memory is False
    assert [str(w.message) for w in caught] == []
    monkeypatch.setattr(adapter, "accelerator_present", lambda: True)
    assert data.loader(num_workers=0).pin_memory is True  # with a GPU, pinned
    assert data.loader(num_workers=0, pin_memory=False).pin_memory is False


def test_tf_example_imports_tensorflow_without_banners() -> None:
    pytest.importorskip("tensorflow")  # the tensorflow extra
    code = ("import sys; sys.path.insert(0, 'examples'); import train_tf; "
            "print('ok', train_tf.tf.__name__, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.strip() == "ok tensorflow"  # no absl / oneDNN banner
