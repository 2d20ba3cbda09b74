"""Benchmark of the tiered sampler: the hot path (issue 18) and large RAM budgets (issue 24).

Run: ``python benchmarks/sample.py [--quick] [--before /path/to/previous/tree] [--rounds N]``
(generates ``benchmarks/_data/sample-bench`` once: ``--gib`` of 224x224x3 uint8 records).

* **Hot path**: the second epoch of a run (the steady state, after the batch buffers were first
  touched) at RAM-block densities of about 1%, 5% and 20% of the dataset, cold (page cache dropped
  on every shard file) and warm; records/s, MB/s and CPU seconds per GB delivered,
  next to a raw sequential scan of the same files (cold) and a plain read of the cached files
  (warm) measured in the same round.
* **Budgets**: RAM budgets of 5%, 25%, 100% and 200% of the dataset, three epochs each, cold before
  every epoch; per epoch MB/s, bytes read from storage and time to the first batch, and the peak
  RSS against the budget (+15%).
* **SSD tier** (``--sections ssd``, issue 17): the second epoch of a run, cold (page cache dropped
  on every shard file before each epoch), of ``tiers=ram`` and of ``tiers=ram,ssd`` with the SSD directory on tmpfs
  (``/dev/shm``) and on the dataset's own disk, next to the raw sequential scan of the same round;
  static cache off, so every record crosses every tier. On one disk each byte crosses the device
  three times (read from the dataset, written to the reservoir, read back unless the reservoir is
  still in the page cache), so a third of the raw scan is the physical bound there.
* **First epochs** (``--sections first``, issue 33): the first epoch of a fresh run (a new process
  for every figure), interleaved per round: ``tiers=ram,ssd`` on tmpfs against ``tiers=ram`` (page
  cache dropped, ``--ssd-ram``/``--ssd-size``); ``ram_size`` twice the dataset (the static cache
  holds it all) cold against the raw sequential scan, and warm (files in the page cache) against the
  same epoch with ``static_cache=0``, node-shared and private (``node_sharing=False``). Every run
  is paired with plain reads of the same files in the same state just before it and just after it
  (the host's page cache is not dropped with the guest's, and the virtual disk's speed drifts within
  seconds, so the "cold" device differs from run to run), its baseline being their geometric mean:
  drift that is linear over the three reads cancels, where a read before alone put all of it on
  the run. Ratios are taken between these paired figures; "read drift" is the spread of
  after / before over the rounds (far from 1: the device changed under the run). Each run also
  reports what its process paid to touch fresh memory just before it ("first touch",
  ``first_touch_cpu``): a first epoch allocates its SSD slots, batch buffers and page-cache pages,
  and on a virtual machine that cost is set by the host and moves between runs like the device.
* ``--device-mbps 300,800``: every section once at each rate, with reads of the dataset's disk
  throttled to it by a cgroup that this process and its children join (``_common.throttled_device``):
  on a virtual machine a dropped page cache leaves the host's, so an unthrottled "cold" read meets the
  host's cache one run and the disk the next; a rate below both makes the device's speed known. The
  tables are headed by the rate (or by why the device could not be throttled: then it runs as without).
* ``--loop-device DIR``: the dataset copied onto a loop device backed by an image file in ``DIR``
  (a tmpfs, e.g. ``/dev/shm``; ``_common.loop_device``) for the whole run, and with
  ``--device-mbps`` that device throttled: the guest's own memory behind a throttle of known rate,
  no host page cache (which makes the virtual disk's "cold" reads 800 MB/s at one moment and
  2.4 GB/s at the next even under the throttle's cap; measured here: the SSD row's spread over
  runs of one tree, RESULTS.md). Needs root.
* ``--first-rows ssd,large``: which rows the first-epoch section runs (the SSD tier's two, the large
  budget's four).
* ``--io-modes``: the bottom tier's read modes on one sparse block: buffered ``preadv`` after
  announcing every run (what the reader does) against ``O_DIRECT`` reads from a thread pool.

Every sampler run is its own process (clean CPU and RSS accounting). ``--before TREE`` runs each
configuration a second time with the shardkit in ``TREE`` (e.g. a checkout of the previous
version), so before and after are compared within one run. The virtual disk's speed drifts by 2-4x
within minutes: compare ratios (each run against the baseline of its own round), not absolute
numbers. Prints markdown tables; the numbers go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from _common import DeviceThrottle, device_rates, drop_cache, loop_device, synthetic_dataset, throttled_device

from shardkit.formats import open_dataset

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data" / "sample-bench"
SHAPE = (224, 224, 3)
REC = int(np.prod(SHAPE))
DENSITIES = (0.01, 0.05, 0.20)
BUDGETS = (0.05, 0.25, 1.0, 2.0)
EPOCHS = 3
AFTER = str(HERE.parent)
#: The first-epoch section's row groups (``--first-rows``): the SSD tier's rows, the large budget's.
FIRST_ROWS = frozenset({"ssd", "large"})


# ---------------------------------------------------------------------------------------------- baselines
def _shard_files(ds_path: Path) -> list[Path]:
    with open_dataset(ds_path) as ds:
        return [ds.payload.shard_path(i) for i in range(len(ds.payload.shards))]


def scan(ds_path: Path, cold: bool) -> dict[str, float]:
    """Every shard file front to back in 8 MiB reads: the raw sequential scan (cold) or a plain
    read of the cached files (warm). MB/s and CPU seconds per GB."""
    files = _shard_files(ds_path)
    if cold:
        drop_cache(ds_path)
    buf = bytearray(8 << 20)
    total = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            while (n := os.readv(fd, [buf])) > 0:
                total += n
        finally:
            os.close(fd)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"mbps": total / dt / 1e6, "cpu_per_gb": cpu / (total / 1e9)}


# ---------------------------------------------------------------------------------------------- one run
def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """One sampler configuration in this (fresh) process; see :func:`run`."""
    import shardkit
    from shardkit.readers import TieredSampler

    # The schedule module of the tree under test (it moved from readers/ to order/); an import by the new
    # name from an older tree could resolve through the editable install into another tree.
    tree = Path(shardkit.__file__).parent
    schedule = importlib.import_module("shardkit.order.schedule" if (tree / "order").is_dir() else "shardkit.readers.schedule")
    assert Path(schedule.__file__).is_relative_to(tree), schedule.__file__

    path, batch = Path(cfg["path"]), cfg["batch"]
    kw: dict[str, Any] = {"batch_size": batch, "epochs": 1, "seed": 0}
    new = hasattr(schedule, "block_limits")
    if cfg.get("block") is not None:
        k = int(cfg["block"])  # force RAM blocks of k records, no cache
        kw.update(ram_size=(2 * k + 4 * batch) * REC)  # two blocks and the batches in flight
        if new:
            schedule.MIN_BLOCK_BYTES = schedule.FIRST_BLOCK_BYTES = k * REC
            kw.update(static_cache=0)
    else:
        kw.update(ram_size=int(cfg["ram"]))
    if cfg.get("ssd_dir"):
        kw.update(tiers="ram,ssd", ssd_dir=cfg["ssd_dir"], ssd_size=int(cfg["ssd"]))
    if cfg.get("static_cache") is not None:
        kw.update(static_cache=cfg["static_cache"])
    if cfg.get("node_sharing") is not None:
        kw.update(node_sharing=cfg["node_sharing"])
    fresh = first_touch_cpu()
    base = _rss_kib()
    s = TieredSampler(path, **kw)
    epochs = []
    for _ in range(cfg["epochs"]):
        if cfg["cold"]:
            drop_cache(path)
        disk0, t0, c0, sys0 = s.stats.disk.bytes_read, time.perf_counter(), time.process_time(), _sys_cpu()
        first, nbytes, records = None, 0, 0
        for b in s:
            if first is None:
                first = time.perf_counter() - t0
            nbytes += b["image"].nbytes
            records += b["key"].shape[0]
            del b
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        epochs.append({"seconds": dt, "bytes": nbytes, "records": records, "cpu": cpu, "sys": _sys_cpu() - sys0,
                       "disk": s.stats.disk.bytes_read - disk0, "first": first or 0.0})  # fmt: skip
    plan = [s.ram_block, s.static_cache] if not new else [*s.block_schedule, s.static_cache]
    return {"epochs": epochs, "peak_rss": _peak_rss_kib() * 1024, "base_rss": base * 1024, "plan": plan,
            "fresh": fresh}  # fmt: skip


def first_touch_cpu(nbytes: int = 64 << 20) -> float:
    """CPU seconds per GB this process spends touching ``nbytes`` of fresh anonymous memory once (a
    page fault, allocation and zeroing a page): what a first epoch pays for its slot files, batch
    buffers and page-cache pages. On a virtual machine it can dwarf the copy (the host backs a guest
    page on its first touch) and drift between runs, so each run reports it next to its figures."""
    m = mmap.mmap(-1, nbytes)
    try:
        pages = np.frombuffer(m, dtype=np.uint8)
        c0 = time.process_time()
        pages[:: mmap.PAGESIZE] = 1
        cpu = time.process_time() - c0
        del pages
    finally:
        m.close()
    return cpu / (nbytes / 1e9)


def _sys_cpu() -> float:
    """This process's CPU seconds in the kernel (page faults, copies from the page cache, allocation)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _rss_kib() -> int:
    return _status("VmRSS")


def _peak_rss_kib() -> int:
    return _status("VmHWM")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def run(tree: str, **cfg: Any) -> dict[str, Any]:
    """Run :func:`worker` in a new process whose ``shardkit`` is the one in ``tree``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, str(HERE)])}
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env, check=True,
                         capture_output=True, text=True, timeout=3600)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rate(e: dict[str, Any]) -> dict[str, float]:
    return {"mbps": e["bytes"] / e["seconds"] / 1e6, "rps": e["records"] / e["seconds"],
            "cpu_per_gb": e["cpu"] / (e["bytes"] / 1e9)}  # fmt: skip


# ---------------------------------------------------------------------------------------------- sections
def hot_path(path: Path, n: int, batch: int, trees: dict[str, str], rounds: int) -> list[str]:
    rows: dict[tuple[str, str, float], list[dict[str, float]]] = {}
    base: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    for _ in range(rounds):
        raw, plain = scan(path, cold=True), None
        base["cold"].append(raw)
        for temp in ("cold", "warm"):
            for d in DENSITIES:
                k = max(batch, round(d * n / batch) * batch)
                for name, tree in trees.items():
                    if temp == "warm":
                        plain = scan(path, cold=False)  # warms the files, then measures the plain read
                    # Two epochs, the second reported: the steady state, without the pool's first touch.
                    res = run(tree, path=str(path), records=n, batch=batch, epochs=2, cold=temp == "cold", block=k)
                    r = _rate(res["epochs"][1])
                    ref = raw if temp == "cold" else plain
                    assert ref is not None
                    r["ratio"] = r["mbps"] / ref["mbps"]
                    rows.setdefault((temp, name, d), []).append(r)
            if temp == "warm" and plain is not None:
                base["warm"].append(plain)
    med = statistics.median
    lines = [
        f"Hot path: {n} records of {REC} B ({n * REC / 1e9:.2f} GB), batch {batch}, second epoch of a run (steady "
        "state), static cache off, "
        f"{rounds} round(s), medians; ratios against the raw scan (cold) / plain cached read (warm) of the same round",
        "",
        "| | block density | records/s | MB/s | ratio | CPU s/GB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for temp in ("cold", "warm"):
        b = base[temp]
        label = "raw sequential scan" if temp == "cold" else "plain read of the cached files"
        lines.append(f"| {label} ({temp}) | | | {med(x['mbps'] for x in b):,.0f} | 1.00 | "
                     f"{med(x['cpu_per_gb'] for x in b):.3f} |")  # fmt: skip
        for name in trees:
            for d in DENSITIES:
                rs = rows[(temp, name, d)]
                lines.append(f"| sampler {name} ({temp}) | {d:.0%} | {med(r['rps'] for r in rs):,.0f} | "
                             f"{med(r['mbps'] for r in rs):,.0f} | {med(r['ratio'] for r in rs):.2f} | "
                             f"{med(r['cpu_per_gb'] for r in rs):.3f} |")  # fmt: skip
    if "before" in trees:
        ratios = [med(r["cpu_per_gb"] for r in rows[(t, "after", d)]) / med(r["cpu_per_gb"] for r in rows[(t, "before", d)])
                  for t in ("cold", "warm") for d in DENSITIES]  # fmt: skip
        lines.append(f"\nCPU per GB after / before: {', '.join(f'{x:.2f}' for x in ratios)} (target <= 0.5)")
    return lines


def budgets(path: Path, n: int, batch: int, trees: dict[str, str], rounds: int) -> list[str]:
    results: dict[tuple[str, float], list[dict[str, Any]]] = {}
    raws = []
    for _ in range(rounds):
        raw = scan(path, cold=True)
        raws.append(raw["mbps"])
        for frac in BUDGETS:
            for name, tree in trees.items():
                res = run(tree, path=str(path), records=n, batch=batch, epochs=EPOCHS, cold=True, ram=int(frac * n * REC))
                res["raw"] = raw["mbps"]
                results.setdefault((name, frac), []).append(res)
    med = statistics.median
    lines = [
        f"Budgets: {n} records ({n * REC / 1e9:.2f} GB), batch {batch}, {EPOCHS} epochs, page cache dropped before "
        f"each, {rounds} round(s), medians; raw scan {med(raws):,.0f} MB/s",
        "",
        "| sampler | budget | plan | epoch | MB/s | x raw | from storage | first batch | peak RSS - start | <= budget+15% |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (name, frac), rs in results.items():
        budget = frac * n * REC
        rss = max(r["peak_rss"] - r["base_rss"] for r in rs)
        for e in range(EPOCHS):
            mbps = med(_rate(r["epochs"][e])["mbps"] for r in rs)
            ratio = med(_rate(r["epochs"][e])["mbps"] / r["raw"] for r in rs)
            disk = med(r["epochs"][e]["disk"] for r in rs)
            first = med(r["epochs"][e]["first"] for r in rs)
            lines.append(
                f"| {name} | {frac:.0%} | {rs[0]['plan']} | {e + 1} | {mbps:,.0f} | {ratio:.2f} | {disk / 1e6:,.1f} MB | "
                f"{first * 1e3:.0f} ms | {rss / 2**20:,.0f} MiB | {'met' if rss <= 1.15 * budget else '**missed**'} |"
            )
    return lines


def ssd_tier(path: Path, n: int, batch: int, trees: dict[str, str], rounds: int, ram: int, ssd: int) -> list[str]:
    """``tiers=ram`` against ``tiers=ram,ssd`` on tmpfs and on the dataset's disk, cold (see module docstring)."""
    disk_dir = path.parent / "_ssd-tier"
    disk_dir.mkdir(exist_ok=True)
    places = {"tiers=ram": None, "tiers=ram,ssd on tmpfs": "/dev/shm", "tiers=ram,ssd on the dataset's disk": str(disk_dir)}
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    raws: list[dict[str, float]] = []
    for _ in range(rounds):
        raw = scan(path, cold=True)
        raws.append(raw)
        for label, where in places.items():
            for name, tree in trees.items():
                # Two epochs, the dataset's page cache dropped before each, the second reported: the
                # steady state (batch buffers and SSD slot files exist), as in the hot path section.
                res = run(tree, path=str(path), records=n, batch=batch, epochs=2, cold=True, ram=ram, ssd=ssd,
                          ssd_dir=where, static_cache=0)  # fmt: skip
                r = _rate(res["epochs"][1])
                r["ratio"] = r["mbps"] / raw["mbps"]
                rows.setdefault((label, name), []).append(r)
    med = statistics.median
    lines = [
        f"SSD tier: {n} records ({n * REC / 1e9:.2f} GB), batch {batch}, ram_size {ram / 2**20:.0f} MiB, ssd_size "
        f"{ssd / 2**20:.0f} MiB, static cache off, second epoch of a run (page cache dropped before each), {rounds} "
        "round(s), medians; ratios against the raw scan and tiers=ram of the same round",
        "",
        "| | records/s | MB/s | x raw | x tiers=ram | CPU s/GB |",
        "|---|---:|---:|---:|---:|---:|",
        f"| raw sequential scan (cold) | | {med(x['mbps'] for x in raws):,.0f} | 1.00 | | "
        f"{med(x['cpu_per_gb'] for x in raws):.3f} |",
    ]
    for name in trees:
        ram_rows = rows[("tiers=ram", name)]
        for label in places:
            rs = rows[(label, name)]
            vs_ram = med(r["mbps"] / q["mbps"] for r, q in zip(rs, ram_rows))  # within each round
            lines.append(f"| {label} ({name}) | {med(r['rps'] for r in rs):,.0f} | {med(r['mbps'] for r in rs):,.0f} | "
                         f"{med(r['ratio'] for r in rs):.2f} | {vs_ram:.2f} | {med(r['cpu_per_gb'] for r in rs):.3f} |")
    return lines


def first_epochs(path: Path, n: int, batch: int, trees: dict[str, str], rounds: int, ram: int, ssd: int,
                 dev: DeviceThrottle | None = None, groups: frozenset[str] = FIRST_ROWS) -> list[str]:  # fmt: skip
    """Epoch 1 of fresh runs (see module docstring); every ratio is taken within its round. With a
    throttled ``dev``, each run's bytes read from the device over the bytes it delivered: 1.0 for a cold
    epoch that reads every record once, less where the guest's page cache still held some. ``groups``:
    the rows run (:data:`FIRST_ROWS`)."""
    dev = dev if dev is not None and dev.cgroup is not None else None
    big = 2 * n * REC
    runs = {  # label: (run config, baseline label or "raw"/"plain")
        "tiers=ram (cold)": (dict(cold=True, ram=ram, static_cache=0), None),
        "tiers=ram,ssd on tmpfs (cold)": (dict(cold=True, ram=ram, ssd=ssd, ssd_dir="/dev/shm", static_cache=0),
                                          "tiers=ram (cold)"),
        "ram_size 2x dataset (cold)": (dict(cold=True, ram=big), "raw"),
        "static_cache=0 (warm)": (dict(cold=False, ram=big, static_cache=0), "plain"),
        "ram_size 2x dataset (warm)": (dict(cold=False, ram=big), "static_cache=0 (warm)"),
        "ram_size 2x dataset, node_sharing=False (warm)": (dict(cold=False, ram=big, node_sharing=False),
                                                           "static_cache=0 (warm)"),
    }
    ssd_rows = ("tiers=ram (cold)", "tiers=ram,ssd on tmpfs (cold)")
    runs = {k: v for k, v in runs.items() if ("ssd" if k in ssd_rows else "large") in groups}
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(rounds):
        for name, tree in trees.items():
            base: dict[str, dict[str, float]] = {}
            for label, (cfg, _) in runs.items():
                # Each run's own plain reads of the files, in the state the run meets (cold: the
                # page cache dropped before each; warm: the first read warms them), one before it
                # and one after: the device's speed drifts between runs and during them, so every
                # figure is taken against the geometric mean of its own two reads.
                plain = scan(path, cold=cfg["cold"])
                read0 = dev.bytes_read() if dev is not None else 0
                res = run(tree, path=str(path), records=n, batch=batch, epochs=1, **cfg)
                read1 = dev.bytes_read() if dev is not None else 0
                after = scan(path, cold=cfg["cold"])
                base[label] = r = _rate(res["epochs"][0])
                r["own"] = r["mbps"] / (plain["mbps"] * after["mbps"]) ** 0.5
                r["drift"] = after["mbps"] / plain["mbps"]
                r["sys_per_gb"] = res["epochs"][0]["sys"] / (res["epochs"][0]["bytes"] / 1e9)
                r["device"] = (read1 - read0) / res["epochs"][0]["bytes"] if dev is not None else -1.0
                r["fresh"] = res.get("fresh", -1.0)
            for label, (_, ref) in runs.items():
                r = dict(base[label])
                r["ratio"] = r["own"] / (base[ref]["own"] if ref in base else 1.0)
                rows.setdefault((label, name), []).append(r)
    med = statistics.median
    lines = [
        f"First epochs: {n} records ({n * REC / 1e9:.2f} GB), batch {batch}, epoch 1 of a fresh run (one process "
        f"each), SSD rows ram_size {ram / 2**20:.0f} MiB, ssd_size {ssd / 2**20:.0f} MiB, large budget "
        f"{big / 2**20:,.0f} MiB; {rounds} round(s); each run paired with plain reads of the files just before "
        "and just after it in the same state (raw scan cold, cached read warm): 'x own read' is the run's MB/s over "
        "the geometric mean of those two reads, 'read drift' the after / before of those reads [min-max], "
        "and a ratio against another row divides the two rows' 'x own read'; median [min-max] over the rounds; "
        "'of which kernel': the CPU s/GB spent in the kernel (first touch of new memory is most of what "
        "differs between rows); 'device / delivered': the bytes the run read from the throttled device over those it "
        "delivered; 'first touch': the CPU s/GB the run's process spent touching 64 MiB of fresh memory before it "
        "(first_touch_cpu) [min-max]",
        "",
        "| | tree | MB/s | CPU s/GB | of which kernel | x own read | read drift | ratio | against | device / delivered "
        "| first touch |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for label, (_, ref) in runs.items():
        for name in trees:
            rs = rows[(label, name)]
            ratios = [r["ratio"] for r in rs]
            spread = f"{med(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]" if ref else ""
            against = {"raw": "raw scan (cold)", "plain": "plain read of the cached files"}.get(ref or "", ref or "")
            device = f"{med(r['device'] for r in rs):.2f}" if dev is not None else ""
            drift, fresh = [r["drift"] for r in rs], [r["fresh"] for r in rs]
            lines.append(f"| {label} | {name} | {med(r['mbps'] for r in rs):,.0f} | {med(r['cpu_per_gb'] for r in rs):.3f} "
                         f"| {med(r['sys_per_gb'] for r in rs):.3f} | {med(r['own'] for r in rs):.2f} "
                         f"| {med(drift):.2f} [{min(drift):.2f}-{max(drift):.2f}] | {spread} | {against} | {device} "
                         f"| {med(fresh):.2f} [{min(fresh):.2f}-{max(fresh):.2f}] |")
    return lines


def io_modes(path: Path, n: int, density: float = 0.05, threads: int = 16) -> list[str]:
    """One sparse block read cold two ways (see module docstring)."""
    with open_dataset(path) as ds:
        pa = ds.payload
        for i in range(len(pa.shards)):
            pa.index(i)
        keys = np.random.default_rng(5).permutation(n)[: max(1, int(density * n))]
        out = pa.empty(keys.size)
        drop_cache(path)
        t0, c0 = time.perf_counter(), time.process_time()
        pa.read(keys, out)
        buffered = (keys.size * REC / (time.perf_counter() - t0) / 1e6, time.process_time() - c0)
        rps = pa.records_per_shard
        fds = {i: os.open(pa.shard_path(i), os.O_RDONLY | os.O_DIRECT) for i in range(len(pa.shards))}
        arena = mmap.mmap(-1, keys.size * REC)  # page aligned, as O_DIRECT needs
        rows = np.frombuffer(arena, dtype=np.uint8).reshape(keys.size, REC)
        order = np.argsort(keys)

        def read(chunk: np.ndarray) -> None:
            for p in chunk.tolist():
                s, r = divmod(int(keys[p]), rps)
                os.preadv(fds[s], [rows[p].data], r * REC)

        drop_cache(path)
        t0, c0 = time.perf_counter(), time.process_time()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, np.array_split(order, threads)))
        direct = (keys.size * REC / (time.perf_counter() - t0) / 1e6, time.process_time() - c0)
        for fd in fds.values():
            os.close(fd)
    gb = keys.size * REC / 1e9
    return [
        f"Bottom-tier read modes, one block of {density:.0%} of the dataset ({keys.size} records), cold:",
        f"- announced buffered preadv (the reader): {buffered[0]:,.0f} MB/s, {buffered[1] / gb:.3f} CPU s/GB",
        f"- O_DIRECT, {threads} threads: {direct[0]:,.0f} MB/s, {direct[1] / gb:.3f} CPU s/GB",
    ]


def sections_at(path: Path, n: int, args: argparse.Namespace, trees: dict[str, str], sections: set[str],
                dev: DeviceThrottle | None) -> list[str]:  # fmt: skip
    """The chosen sections' tables, at the device's current rate."""
    ram, ssd = int(args.ssd_ram * 2**20), int(args.ssd_size * 2**20)
    out: list[str] = []
    if "hot" in sections:
        out += [*hot_path(path, n, args.batch, trees, args.rounds), ""]
    if "budgets" in sections:
        out += [*budgets(path, n, args.batch, trees, args.rounds), ""]
    if "ssd" in sections:
        out += [*ssd_tier(path, n, args.batch, trees, args.rounds, ram, ssd), ""]
    if "first" in sections:
        groups = frozenset(args.first_rows.split(","))
        out += [*first_epochs(path, n, args.batch, trees, args.rounds, ram, ssd, dev, groups), ""]
    if args.io_modes:
        out += io_modes(path, n)
    return out


def run_sections(path: Path, n: int, args: argparse.Namespace, trees: dict[str, str], sections: set[str]) -> None:
    """Print the chosen sections at each ``--device-mbps`` rate, the device of ``path`` throttled."""
    device: contextlib.AbstractContextManager[DeviceThrottle | None] = (
        throttled_device(path) if args.device_mbps else contextlib.nullcontext())
    with device as dev:  # every process of the run (the scans, each sampler's) reads through it
        for mbps in device_rates(args.device_mbps):
            head = [f"Device: {dev.set(mbps)}", ""] if dev is not None else []
            print("\n".join(head + sections_at(path, n, args, trees, sections, dev)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=0.85, help="dataset size (the issues measured ~0.9 GB)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="repeat every measurement; report medians")
    ap.add_argument("--before", help="a shardkit tree to compare with (its sampler runs the same configurations)")
    ap.add_argument("--quick", action="store_true", help="a small dataset and one round: a smoke run")
    ap.add_argument("--io-modes", action="store_true", help="also compare buffered and O_DIRECT reads")
    ap.add_argument("--sections", default="hot,budgets,ssd", help="comma-separated: hot, budgets, ssd, first")
    ap.add_argument("--ssd-ram", type=float, default=128, help="SSD section: ram_size in MiB")
    ap.add_argument("--ssd-size", type=float, default=512, help="SSD section: ssd_size in MiB")
    ap.add_argument("--device-mbps", help="comma-separated read rates in MB/s: every section runs once at each "
                    "with the dataset's disk throttled to it (a device of known speed; needs root and a cgroup io "
                    "controller, else says so and runs unthrottled)")
    ap.add_argument("--first-rows", default="ssd,large", help="first-epoch section's rows: ssd, large")
    ap.add_argument("--loop-device", help="a tmpfs directory: the dataset is copied onto a loop device backed by an "
                    "image file there for the run (with --device-mbps, that device is throttled; needs root)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.quick:
        args.gib, args.rounds, args.ssd_ram, args.ssd_size = 0.06, 1, 16, 32
    n = int(args.gib * 2**30 // REC)
    path = synthetic_dataset(DATA.with_name(DATA.name + ("-quick" if args.quick else "")), n)
    trees = {"after": AFTER, **({"before": args.before} if args.before else {})}
    sections = set(args.sections.split(","))
    with contextlib.ExitStack() as stack:
        if args.loop_device:
            path = stack.enter_context(loop_device(path, Path(args.loop_device)))
        run_sections(path, n, args, trees, sections)


if __name__ == "__main__":
    main()
