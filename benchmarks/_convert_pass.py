"""One measured conversion pass in a fresh interpreter, with its CPU split by stage (``benchmarks/convert.py``).

Run as ``python _convert_pass.py MODE SRC OUT [--warmup N]`` with the shardkit tree to measure first on
``PYTHONPATH`` (so ``convert.py --before TREE`` measures an older tree with the same code); MODE is
``bare`` (the bare Pillow loop of ``_convert_peers.transform``), ``bare2`` (the same loop split over 2
forked processes: the machine's own 2-process speed-up at that moment), ``w1`` or ``w2`` (``shardkit.convert``
with 1 or 2 workers). Prints one JSON line: wall ``seconds``, the CPU seconds of this process (``own``)
and of its ended children (``children``: the decode workers), the machine's idle share, the wall
``first``/``last`` progress marks, the seconds the main thread was blocked (``main_blocked``: its wall
time less its CPU and its wait for a core, so a loaded machine's queue is not counted: cold reads, the
GIL, waiting for workers) and the per-stage CPU seconds:

* ``decode`` (``images._decode``: open, header, JPEG decode) and ``resize`` (``images.to_rgb`` and
  ``ImageTransform._apply``: colour, resize, crop, array), each split by where it ran: ``main`` (this
  process) or ``worker`` (the decode workers; a shared anonymous mapping made before they fork carries
  their sums back);
* ``task``: a worker's whole task (``decoding._decode_chunk``: the decodes, resizes and the copy into
  the ring); what the workers spend outside it (pickling, the pipes, start and exit) is ``children`` less it;
* ``write``: the conversion's writer thread (``pipeline.BackgroundWriter._run``), thread CPU;
* ``commit``: this process's CPU and wall during ``partrun.commit`` (the serial end).

Stages are found by name and wrapped in this process before the conversion starts, so nothing of
shardkit changes; a stage the tree lacks is reported as missing. Before the measured pass, ``--warmup``
images (default 32, another output directory) are converted the same way: imports, the pool's first
start and malloc's first growth are not what a conversion of hours pays per image.
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import multiprocessing as mp
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

#: Stage columns of the shared sums: CPU seconds and calls, in this process (row 0) and in workers (row 1).
STAGES = ("decode", "resize", "task")


class StageClock:
    """CPU seconds and calls per stage, summed over this process and its forked workers."""

    def __init__(self) -> None:
        self._mem = mmap.mmap(-1, 8 * 2 * len(STAGES) * 2)  # anonymous and shared: forked workers add to it
        self.sums = np.frombuffer(self._mem, dtype=np.float64).reshape(2, len(STAGES), 2)
        self._lock = mp.get_context("fork").Lock()
        self._owner = os.getpid()

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        col = STAGES.index(stage)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.thread_time() - t0
                row = 0 if os.getpid() == self._owner else 1
                with self._lock:
                    self.sums[row, col, 0] += dt
                    self.sums[row, col, 1] += 1

        return timed

    def report(self) -> dict[str, dict[str, float]]:
        return {stage: {"main": float(self.sums[0, i, 0]), "worker": float(self.sums[1, i, 0]),
                        "calls": float(self.sums[:, i, 1].sum())} for i, stage in enumerate(STAGES)}


def rusage_cpu(who: int) -> float:
    """CPU seconds (user + system) of ``who`` (``resource.RUSAGE_SELF``: this process, every thread;
    ``RUSAGE_CHILDREN``: its ended children that were waited for)."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def machine_idle() -> tuple[int, int]:
    """``(idle + iowait, total)`` jiffies of every CPU since boot (``/proc/stat``; ``(0, 0)`` elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    return ticks[3] + ticks[4], sum(ticks)


def thread_sched() -> tuple[float, float]:
    """``(CPU seconds, seconds waiting for a core)`` of the calling thread so far (``/proc/thread-self/schedstat``;
    zeros elsewhere): its wall time less both is the time it was blocked (a read, a lock, the GIL, a result)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu_ns, wait_ns = (int(v) for v in f.read().split()[:2])
    except (OSError, ValueError):
        return 0.0, 0.0
    return cpu_ns / 1e9, wait_ns / 1e9


def instrument(clock: StageClock, thread: dict[str, float]) -> list[str]:
    """Wrap the stages of the shardkit on the path; returns the stages this tree lacks."""
    from shardkit.converters import decoding, images, partrun, pipeline
    from shardkit.formats import writer

    missing = []
    if hasattr(decoding, "_decode_chunk"):  # looked up by name at each submit, pickled by reference
        decoding._decode_chunk = clock.wrap("task", decoding._decode_chunk)
    else:
        missing.append("decoding._decode_chunk")
    for name, stage in (("_decode", "decode"), ("to_rgb", "resize")):
        if hasattr(images, name):
            setattr(images, name, clock.wrap(stage, getattr(images, name)))
        else:
            missing.append(f"images.{name}")
    if hasattr(images.ImageTransform, "_apply"):
        images.ImageTransform._apply = clock.wrap("resize", images.ImageTransform._apply)  # type: ignore[method-assign]
    else:
        missing.append("ImageTransform._apply")
    run = getattr(pipeline.BackgroundWriter, "_run", None)
    if run is not None:
        @functools.wraps(run)
        def writer_run(self: Any) -> None:
            t0 = time.thread_time()
            try:
                run(self)
            finally:
                thread["write"] += time.thread_time() - t0

        pipeline.BackgroundWriter._run = writer_run  # type: ignore[method-assign]
    else:
        missing.append("BackgroundWriter._run")
    close = writer.ShardWriter.close

    @functools.wraps(close)
    def timed_close(self: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return close(self)
        finally:
            thread["last_close_wall"] = time.perf_counter() - t0  # the pass's last shard: the serial end's

    writer.ShardWriter.close = timed_close  # type: ignore[method-assign]
    commit = getattr(partrun, "commit", None)
    if commit is not None:
        @functools.wraps(commit)
        def timed_commit(*args: Any, **kwargs: Any) -> Any:
            c0, t0 = rusage_cpu(resource.RUSAGE_SELF), time.perf_counter()
            try:
                return commit(*args, **kwargs)
            finally:
                thread["commit"] += rusage_cpu(resource.RUSAGE_SELF) - c0
                thread["commit_wall"] += time.perf_counter() - t0

        partrun.commit = timed_commit
    else:
        missing.append("partrun.commit")
    return missing


#: Columns of :func:`stage_split`, in the order the tables show them.
SPLIT = ("decode", "resize", "task other", "worker IPC", "client", "write", "commit", "total")


def stage_split(res: dict[str, Any]) -> dict[str, float]:
    """CPU milliseconds per image of each stage of one pass (:data:`SPLIT`): the decode and resize
    wherever they ran, the rest of a worker's task (the decoder's own work and the copy into the ring:
    ``task other``), the workers' CPU outside their tasks (pickling, pipes, start and exit: ``worker
    IPC``), this process's CPU outside every other stage (the scan, the decode loop, batching: ``client``),
    the writer thread and the commit; ``total`` is every process's CPU."""
    n = max(1, int(res["images"]))
    st = res["stages"]
    decode, resize = st["decode"]["main"] + st["decode"]["worker"], st["resize"]["main"] + st["resize"]["worker"]
    in_workers = st["decode"]["worker"] + st["resize"]["worker"]
    task = st.get("task", {}).get("worker", 0.0)
    out = {
        "decode": decode, "resize": resize,
        "task other": max(0.0, task - in_workers) if task else 0.0,
        "worker IPC": max(0.0, res["children"] - (task or in_workers)),
        "client": res["own"] - st["decode"]["main"] - st["resize"]["main"] - res["write"] - res["commit"],
        "write": res["write"], "commit": res["commit"], "total": res["own"] + res["children"],
    }
    return {k: 1000 * v / n for k, v in out.items()}


def cpu_bound_time(split: dict[str, float], workers: int) -> float:
    """Milliseconds per image a pass with this CPU split needs on ``workers`` free cores (2 here) when
    nothing waits for a device: the streaming part is bound by the busiest thread or by every core
    busy, the commit runs alone after it. With 1 worker the decode loop and the writer thread overlap;
    with 2, the decode workers, the parent's loop and its writer share the two cores."""
    end = split["commit"]
    if workers == 1:
        loop = split["total"] - split["write"] - end
        return max(loop, split["write"]) + end
    workers_cpu = split["decode"] + split["resize"] + split["task other"] + split["worker IPC"]
    parent_loop = split["client"]
    return max((split["total"] - end) / 2, workers_cpu / workers, parent_loop, split["write"]) + end


def _bare(src: Path) -> Callable[[], int]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _convert_peers import corpus, transform

    files = [path for path, _ in corpus(src)]

    def run() -> int:
        acc = 0
        for f in files:
            acc += int(transform(f)[0, 0, 0])
        return len(files)

    return run


def _bare_two(src: Path) -> Callable[[], int]:
    """The bare loop split over 2 forked processes in contiguous halves, started before the clock and
    released together: the parallel speed-up this machine offers at that moment for this very work,
    with no conversion overhead (the ceiling of ``w2`` over ``w1`` in the same round)."""
    import multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _convert_peers import corpus, transform

    files = [path for path, _ in corpus(src)]
    ctx = mp.get_context("fork")
    go = ctx.Event()
    half = len(files) // 2

    def loop(part: list[Any]) -> None:
        go.wait(120)
        for f in part:
            transform(f)

    procs = [ctx.Process(target=loop, args=(part,)) for part in (files[:half], files[half:])]
    for proc in procs:
        proc.start()

    def run() -> int:
        go.set()
        for proc in procs:
            proc.join()
            if proc.exitcode:
                raise RuntimeError(f"a bare-loop process exited with {proc.exitcode}")
        return len(files)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("bare", "bare2", "w1", "w2"))
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--warmup", type=int, default=32, help="images converted before the measured pass")
    args = ap.parse_args()
    clock = StageClock()
    thread = {"write": 0.0, "commit": 0.0, "commit_wall": 0.0, "last_close_wall": 0.0}
    marks: list[tuple[float, int]] = []
    if args.mode in ("bare", "bare2"):
        run = _bare(args.src) if args.mode == "bare" else _bare_two(args.src)
        missing: list[str] = []
    else:
        import shardkit

        missing = instrument(clock, thread)
        workers = int(args.mode[1])
        if args.warmup:
            warm_src = args.out.with_name(args.out.name + "-warmsrc")
            shutil.rmtree(warm_src, ignore_errors=True)
            for k, f in enumerate(sorted(args.src.rglob("*.jpg"))[: args.warmup]):
                (warm_src / f"c{k % 2}").mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, warm_src / f"c{k % 2}" / f.name)
            shardkit.convert(warm_src, args.out.with_name(args.out.name + "-warm"), kind="imagefolder",
                             workers=workers, progress=False, overwrite=True)
            shutil.rmtree(warm_src, ignore_errors=True)
            shutil.rmtree(args.out.with_name(args.out.name + "-warm"), ignore_errors=True)
            clock.sums[:] = 0
            thread.update(write=0.0, commit=0.0, commit_wall=0.0, last_close_wall=0.0)
        shutil.rmtree(args.out, ignore_errors=True)

        def progress(done: int, total: int, records: int) -> None:
            marks.append((time.perf_counter() - start[0], done))

        def run() -> int:
            return int(shardkit.convert(args.src, args.out, kind="imagefolder", workers=workers,
                                        progress=progress).records)

    start = [0.0]
    own0, kids0, (idle0, total0) = rusage_cpu(resource.RUSAGE_SELF), rusage_cpu(resource.RUSAGE_CHILDREN), machine_idle()
    sched0 = thread_sched()
    start[0] = time.perf_counter()
    n = run()
    seconds = time.perf_counter() - start[0]
    sched1 = thread_sched()
    main_cpu, main_wait = sched1[0] - sched0[0], sched1[1] - sched0[1]
    own, kids, (idle1, total1) = rusage_cpu(resource.RUSAGE_SELF) - own0, rusage_cpu(resource.RUSAGE_CHILDREN) - kids0, machine_idle()
    shutil.rmtree(args.out, ignore_errors=True)
    print(json.dumps({
        "images": n, "seconds": seconds, "own": own, "children": kids,
        "idle": (idle1 - idle0) / max(1, total1 - total0),
        "main_blocked": max(0.0, seconds - main_cpu - main_wait) if main_cpu else None, "main_runq": main_wait,
        "first": marks[0][0] if marks else None, "last": marks[-1][0] if marks else None,
        "stages": clock.report(), **thread, "missing": missing,
        "tree": str(Path(sys.modules["shardkit"].__file__).parents[1]) if "shardkit" in sys.modules else None,
    }))


if __name__ == "__main__":
    main()
