"""Conversion on a real Dask cluster (issue 22): a scheduler and two ``dask worker --nworkers 1 --nthreads 1``
on loopback, started by the fixture and stopped at the end.

The bundled corpora converted on the cluster equal the one-process conversion record for record; a
worker SIGKILLed while it runs a part has the part redone on the other one, with the same result; the
client SIGKILLed at every other step (planning, commit, cleanup; every single step in
tests/converters/test_parts.py) is finished by the same command without converting a finished part
again; an append on the cluster equals converting both corpora in one go; a worker that cannot see
the corpus says which worker and which path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shardkit
from shardkit.converters import register
from shardkit.errors import WorkerError
from shardkit.formats import verify
from tests.converters.fault_injection import inject
from tests.converters.kinds_for_parts import SlowImages, VanishingImages
from tests.helpers.parts import DATASETS, REPO, assert_same_records, class_corpus

pytest.importorskip("distributed")  # the dask extra

from tests.helpers.dask_cluster import DaskCluster  # after importorskip: needs the extra

# One worker under pytest-xdist: the module's tests share one Dask cluster (the `cluster` fixture).
pytestmark = [pytest.mark.xdist_group("converters-cluster"), pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[DaskCluster]:
    try:  # the workers get the S3 settings of the session's SeaweedFS server, when the remote extra is there
        env = request.getfixturevalue("seaweed").env()
    except pytest.skip.Exception:
        env = {}
    c = DaskCluster(tmp_path_factory.mktemp("dask"), env=env)
    try:
        yield c
    finally:
        c.close()


# Shard sizes of 3 and 4 records (the command line takes a size: records of 32x32x3 and 24x24x3 bytes plus
# their 16-byte index entries).
CORPORA = {
    "coco": (DATASETS / "coco", dict(kind="coco", size=32, shard_bytes=3 * (32 * 32 * 3 + 16)), 4),
    "imagefolder": (DATASETS / "imagefolder", dict(size=24, shard_bytes=4 * (24 * 24 * 3 + 16)), 5),
    "speech": (DATASETS / "speech", dict(window=True, duration=0.25, sample_rate=8000, records_per_shard=5), 4),
}


def _cli_args(options: dict) -> list[str]:
    args = []
    for k, v in options.items():
        flag = "--shard-size" if k == "shard_bytes" else "--" + k.replace("_", "-")
        args += [flag] if v is True else [flag, str(v)]
    return args


@pytest.mark.parametrize("name", list(CORPORA))
def test_bundled_corpora_on_the_cluster_equal_one_process(cluster: DaskCluster, tmp_path: Path, name: str) -> None:
    src, options, part_size = CORPORA[name]
    shardkit.convert(src, tmp_path / "one", workers=1, **options)
    out = tmp_path / "cluster"
    if name == "imagefolder":  # the command line, --scheduler
        r = subprocess.run([sys.executable, "-m", "shardkit", "convert", str(src), "-o", str(out), "--scheduler",
                            cluster.address, "--part-size", str(part_size), *_cli_args(options)],
                           capture_output=True, text=True, timeout=600, cwd=REPO)
        assert r.returncode == 0, r.stderr
        assert "parts        " in r.stdout and "records" in r.stderr  # the bar counts records across the cluster
    elif name == "coco":  # the command line, the scheduler from DASK_SCHEDULER_ADDRESS
        r = subprocess.run([sys.executable, "-m", "shardkit", "convert", str(src), "-o", str(out), "--part-size",
                            str(part_size), "-q", *_cli_args(options)], capture_output=True, text=True, timeout=600,
                           cwd=REPO, env={**os.environ, "DASK_SCHEDULER_ADDRESS": cluster.address})
        assert r.returncode == 0, r.stderr
        assert f"converting on the Dask cluster at {cluster.address} (from DASK_SCHEDULER_ADDRESS" in r.stderr
    else:  # Python, with a progress callback
        seen: list[tuple[int, int, int]] = []
        s = shardkit.convert(src, out, scheduler=cluster.address, part_size=part_size,
                             progress=lambda *a: seen.append(a), **options)
        assert s.parts_converted == s.parts > 1 and s.records > s.parts
        assert seen[-1] == (seen[-1][1], seen[-1][1], s.records)  # every input and record, counted on the workers
        assert [x[2] for x in seen] == sorted(x[2] for x in seen)
    assert_same_records(out, tmp_path / "one")
    assert verify(out).ok


def test_a_worker_killed_mid_part_has_its_part_redone(cluster: DaskCluster, tmp_path: Path) -> None:
    from distributed import Client

    register(SlowImages, replace=True)
    src = class_corpus(tmp_path / "corpus", ["landscape", "object", "plant"], bad={"plant/zero.jpg": ""})
    shardkit.convert(src, tmp_path / "one", size=16, records_per_shard=4, workers=1)
    killed: list[str] = []
    names = {addr: name for name, addr in cluster.worker_addresses().items()}

    def kill_a_busy_worker(done: int, total: int, records: int) -> None:
        if killed or records == 0:
            return
        with Client(cluster.address, set_as_default=False) as c:
            deadline = time.monotonic() + 10  # between two parts a worker can be idle for a moment
            busy = [addr for addr, tasks in c.processing().items() if tasks]
            while not busy and time.monotonic() < deadline:
                time.sleep(0.05)
                busy = [addr for addr, tasks in c.processing().items() if tasks]
        if busy:  # SIGKILL a worker (and its nanny) while it runs a part
            name = names[busy[0]]
            cluster.kill_worker(int(name[1:]))
            killed.append(name)

    try:
        s = shardkit.convert(src, tmp_path / "cluster", kind="slowimages", size=16, records_per_shard=4,
                             scheduler=cluster.address, part_size=3, progress=kill_a_busy_worker)
    finally:
        for name in killed:
            cluster.start_worker(int(name[1:]))
    assert killed and s.parts_converted == s.parts
    assert_same_records(tmp_path / "cluster", tmp_path / "one")


def test_client_killed_at_every_step_resumes_without_redoing_parts(cluster: DaskCluster, tmp_path: Path) -> None:
    src = class_corpus(tmp_path / "corpus", ["landscape", "object"], bad={"object/zero.jpg": ""})
    spec = {"src": str(src), "out": str(tmp_path / "out"),
            "kwargs": {"size": 16, "records_per_shard": 3, "part_size": 5, "scheduler": cluster.address}, "every": 2}
    report = inject(spec)
    # The client's own steps: claiming the plan directory, then every step of the commit and its cleanup.
    assert report["reference"] == "ok" and report["steps"] >= 25 and report["parts"] == 3, report
    for r in report["runs"]:
        assert r["first"] == "killed" and r["final"] == "ok" and r["same"], r
        expected = 0 if r["committed_before"] else report["parts"] - r["parts_done_before"]
        assert r["parts_converted"] == expected, r
    # Kills during the commit: every part was finished, and none was converted again.
    assert sum(r["parts_done_before"] == 3 and r["parts_converted"] == 0 for r in report["runs"]) >= 5


def test_append_on_the_cluster_equals_one_go(cluster: DaskCluster, tmp_path: Path) -> None:
    whole = class_corpus(tmp_path / "whole", ["landscape", "object", "plant"])
    first = class_corpus(tmp_path / "first", ["landscape", "object"])
    second = class_corpus(tmp_path / "second", ["plant"])
    shardkit.convert(whole, tmp_path / "one", size=16, records_per_shard=3, workers=1)
    shardkit.convert(first, tmp_path / "grown", size=16, records_per_shard=3, scheduler=cluster.address, part_size=4)
    r = subprocess.run([sys.executable, "-m", "shardkit", "convert", str(second), "-o", str(tmp_path / "grown"),
                        "--append", "--size", "16", "--scheduler", cluster.address, "--part-size", "2", "-q"],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "version      2" in r.stdout and ", 23 in all" in r.stdout
    assert_same_records(tmp_path / "grown", tmp_path / "one", roots=(whole, first, second))


def test_a_worker_that_cannot_see_the_corpus_says_so(cluster: DaskCluster, tmp_path: Path) -> None:
    register(VanishingImages, replace=True)
    src = class_corpus(tmp_path / "corpus", ["landscape"])
    try:
        with pytest.raises(WorkerError) as info:
            shardkit.convert(src, tmp_path / "out", kind="vanishingimages", size=16, scheduler=cluster.address,
                             part_size=2)
    finally:
        src.with_name("corpus.moved").rename(src)
    message = str(info.value)
    assert f"cannot see the corpus {src}" in message and "Dask worker tcp://127.0.0.1:" in message
    assert "same paths" in message


def test_cluster_conversion_into_a_bucket(cluster: DaskCluster, s3: Any, tmp_path: Path) -> None:
    # Workers upload their parts' shards, pieces and manifests; the commit copies server-side and
    # uploads what it builds; the root document goes last.
    src, options, part_size = CORPORA["imagefolder"]
    shardkit.convert(src, tmp_path / "one", workers=1, **options)
    url = s3.url("cluster")
    s = shardkit.convert(src, url, scheduler=cluster.address, part_size=part_size, **options)
    assert s.output == url and s.parts_converted == s.parts > 1
    assert_same_records(url, tmp_path / "one")
    assert verify(url).ok


def test_write_on_the_cluster_equals_one_process(cluster: DaskCluster, tmp_path: Path) -> None:
    # shardkit.write runs on the same engine: a function the workers import, over a list of inputs.
    fn, inputs = "tests.converters.write_fns:windows", [str(i) for i in range(13)]
    shardkit.write(fn, inputs, tmp_path / "one", workers=1, records_per_shard=4, progress=False)
    s = shardkit.write(fn, inputs, tmp_path / "cluster", scheduler=cluster.address, part_size=3, records_per_shard=4,
                       progress=False)
    assert s.parts == s.parts_converted == 5 and s.skipped == {"empty": 4}  # inputs 0, 4, 8, 12
    assert_same_records(tmp_path / "cluster", tmp_path / "one")
    assert verify(tmp_path / "cluster").ok
