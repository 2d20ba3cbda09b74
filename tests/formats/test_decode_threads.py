"""The reader's decode threads (``formats/decode_threads.py``): jobs whose completion is a C-level
lock, errors raised in read order by the thread that waits, and threads that end with their pool.
A read's decode threads run no Python-level synchronisation (``threading``'s conditions and
semaphores, ``concurrent.futures``) per job: the decoders return into Python between records, and
every bytecode one runs under the GIL is one the other decoder may wait for."""

from __future__ import annotations

import gc
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest

from shardkit.formats import open_dataset
from shardkit.formats.decode_threads import DecodeThreads, finish_decodes, wait_decodes
from tests.helpers.datasets import write_dataset


def test_finish_decodes_raises_the_first_error_in_job_order_once_every_job_ran() -> None:
    pool = DecodeThreads(2, "test-decode")
    gate = threading.Event()
    ran: list[int] = []

    def slow_failure() -> None:
        gate.wait(5)
        ran.append(1)
        raise ValueError("first")

    def fast_failure() -> None:
        ran.append(2)
        raise KeyError("second")

    jobs = [pool.submit(slow_failure), pool.submit(fast_failure)]
    jobs[1].wait()
    assert jobs[1].done() and not jobs[0].done()
    gate.set()
    with pytest.raises(ValueError, match="first"):
        finish_decodes(jobs)
    assert sorted(ran) == [1, 2] and all(j.done() for j in jobs)
    wait_decodes(jobs)  # waiting again returns at once
    pool.shutdown()


def test_decode_threads_end_at_shutdown_and_when_collected() -> None:
    def alive(prefix: str) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith(prefix)]

    pool = DecodeThreads(3, "test-shutdown")
    assert len(alive("test-shutdown_")) == 3
    pool.submit(lambda: None).result()
    pool.shutdown()
    assert not alive("test-shutdown_")

    DecodeThreads(2, "test-collected")
    gc.collect()
    for t in alive("test-collected_"):
        t.join(5)
    assert not alive("test-collected_")


def test_a_read_runs_no_python_synchronisation_on_its_decode_threads(tmp_path: Path) -> None:
    pytest.importorskip("imagecodecs")
    y, x = np.mgrid[0:24, 0:32]
    images = np.stack([np.stack([x * 7 + i, y * 9, (x + y) * 4 + 3 * i], axis=-1) % 256 for i in range(40)]).astype(np.uint8)
    path = write_dataset(tmp_path / "ds", images, records_per_shard=7, compression="jpeg")
    calls: set[str] = set()
    reading = threading.Event()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and reading.is_set() and threading.current_thread().name.startswith("shardkit-decode"):
            name, function = frame.f_code.co_filename, frame.f_code.co_name
            if (name.endswith("threading.py") and function != "run") or "concurrent" in name:  # run: the thread's start
                calls.add(f"{Path(name).name}:{function}")

    threading.setprofile(profile)  # every thread started from here on: the decode threads start at the first read
    try:
        with open_dataset(path, decode_workers=2) as ds:
            keys = np.arange(0, 40, 3)
            reading.set()
            got = ds.payload.read(keys)
            reading.clear()
            expected = np.stack([ds.payload.read([int(k)])[0] for k in keys])
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.setprofile(None)
    np.testing.assert_array_equal(got, expected)
    assert not calls, sorted(calls)


def _read_in_child(payload: Any, keys: np.ndarray, expected: np.ndarray, results: Any) -> None:
    """The body of a forked child: read with the reader it inherited, say whether the rows match."""
    results.put(bool(np.array_equal(payload.read(keys), expected)))


def test_a_reader_used_before_a_fork_decodes_in_the_child(tmp_path: Path) -> None:
    """The child inherits the pool's objects but not its threads: its first decode starts its own."""
    pytest.importorskip("imagecodecs")
    import multiprocessing

    y, x = np.mgrid[0:24, 0:32]
    images = np.stack([np.stack([x * 5 + i, y * 3, (x + y) * 2 + i], axis=-1) % 256 for i in range(30)]).astype(np.uint8)
    path = write_dataset(tmp_path / "ds", images, records_per_shard=7, compression="jpeg")
    context = multiprocessing.get_context("fork")
    with open_dataset(path, decode_workers=2) as ds:
        keys = np.arange(0, 30, 2)
        expected = ds.payload.read(keys)  # the parent's decode threads are running now
        results = context.SimpleQueue()
        child = context.Process(target=_read_in_child, args=(ds.payload, keys, expected, results))
        child.start()
        child.join(60)
        if child.is_alive():
            child.kill()
            child.join()
            pytest.fail("the forked child's read hung")
        assert child.exitcode == 0 and results.get() is True
        np.testing.assert_array_equal(ds.payload.read(keys), expected)  # the parent's pool is untouched
