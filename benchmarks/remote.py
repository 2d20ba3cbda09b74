"""Reading a dataset from an object store: shardkit's remote tier against the raw bandwidth and peers.

Everything runs against a local SeaweedFS server (``weed mini`` from the dev extra), optionally
behind a small userspace TCP proxy that delays every client-to-server packet by ``D`` ms (the
kernel's netem is not available here), so each request pays ``D`` more round-trip time, as on a
real object store (20-100 ms). For each added latency:

* **raw**: the fastest raw read the server gives: every shard object fetched whole with parallel
  GETs (best of several concurrencies) -- the baseline all ratios refer to;
* **shardkit ram** / **ram,ssd**: one epoch of ``TieredSampler`` in the exact uniform order (RAM
  budget a fraction of the dataset, so blocks are sparse as in real training), bytes delivered per
  second, requests and bytes fetched per epoch: without a cache (ranged reads), and with
  ``cache_dir`` on the local disk, **cold** (cache emptied first: the shards are prefetched whole,
  :mod:`shardkit.stores.prefetch`) and **warm** (the next epoch, all local);
* ``--sweep``: the same at several ``remote_gap_bytes`` thresholds (how the default was chosen);
* ``--peers``: MosaicML Streaming and LitData reading the same records from the same server with
  their shuffles on (run in the bench venv, see ``benchmarks/_remote_peers.py``).

Usage::

    python benchmarks/remote.py --quick            # ~100 MB, a smoke run
    python benchmarks/remote.py --peers --sweep    # 8,000 x 128 KiB, the full table

Numbers move between runs on a shared machine: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RECORD_SHAPE = (128, 256, 4)  # 128 KiB, the record size of ANCHORS.md's peer measurements
BENCH_PYTHON = Path(os.environ.get("SHARDKIT_BENCH_PYTHON", "/work/benchvenv/bin/python"))


# ---------------------------------------------------------------------- the delaying proxy
async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``reader`` to ``writer``; with ``delay``, every chunk leaves ``delay`` s after it came."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def sender() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    task = asyncio.ensure_future(sender()) if delay else None
    try:
        while data := await reader.read(1 << 20):
            if task is None:
                writer.write(data)
                await writer.drain()
            else:
                queue.put_nowait((time.monotonic() + delay, data))
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        if task is not None:
            queue.put_nowait((0.0, b""))
            await asyncio.gather(task, return_exceptions=True)
        else:
            writer.close()


def run_proxy(listen: int, upstream: int, delay_ms: float) -> None:
    """Serve forever: each connection to ``listen`` is relayed to ``upstream``, requests delayed."""

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", upstream, limit=1 << 22)
        except OSError:
            cw.close()
            return
        await asyncio.gather(_pump(cr, uw, delay_ms / 1000), _pump(ur, cw, 0.0), return_exceptions=True)

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", listen, limit=1 << 22, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


class DelayProxy:
    """The proxy in its own process (its own GIL), on a free port."""

    def __init__(self, upstream: int, delay_ms: float) -> None:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.proc = subprocess.Popen([sys.executable, __file__, "--proxy", str(self.port), str(upstream), str(delay_ms)])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("delay proxy did not start")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# ---------------------------------------------------------------------- data
def make_dataset(path: Path, n: int, records_per_shard: int) -> Path:
    from shardkit.formats import DatasetWriter, FieldSpec

    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, size=(64, *RECORD_SHAPE), dtype=np.uint8)
    with DatasetWriter(path, kind="bench", payload="image", record=FieldSpec(RECORD_SHAPE, "uint8"),
                       fields={"label": FieldSpec((), "int64")}, records_per_shard=records_per_shard) as w:
        for a in range(0, n, 64):
            k = np.arange(a, min(a + 64, n))
            recs = pattern[: k.size].copy()
            recs.reshape(k.size, -1)[:, :8] = k[:, None].view(np.uint8).reshape(k.size, 8)  # key in the first bytes
            w.write({"image": recs, "label": k % 1000})
    return path


# ---------------------------------------------------------------------- measurements
def raw_whole_objects(url: str, keys: list[str], concurrency: int) -> float:
    """MB/s of fetching every object whole with ``concurrency`` parallel GETs."""
    from shardkit.stores import open_store

    store = open_store(url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        total = sum(ex.map(lambda k: len(store.get(k)), keys))
    return total / 1e6 / (time.perf_counter() - t0)


def shardkit_epoch(url: str, tiers: str, ram_size: int, ssd_dir: Path, **kw: Any) -> dict[str, Any]:
    from shardkit.readers import TieredSampler

    s = TieredSampler(url, tiers=tiers, ram_size=ram_size, ssd_size=max(2 * ram_size, 4 * ram_size), ssd_dir=ssd_dir,
                      batch_size=64, epochs=1, seed=1, **kw)
    t0 = time.perf_counter()
    first = None
    n = 0
    for batch in s:
        first = first or time.perf_counter() - t0
        n += batch["key"].size
    dt = time.perf_counter() - t0
    return {
        "MB/s": s.stats.bytes / 1e6 / dt, "records": n, "requests": s.stats.disk.read_calls,
        "fetched_MB": s.stats.disk.bytes_read / 1e6, "first_batch_s": first,
    }


def peer(system: str, endpoint: str, bucket: str, prefix: str, n: int, workdir: Path) -> dict[str, Any]:
    if not BENCH_PYTHON.exists():
        return {"error": f"{BENCH_PYTHON} not found (set SHARDKIT_BENCH_PYTHON to the bench venv's python)"}
    cmd = [str(BENCH_PYTHON), str(HERE / "_remote_peers.py"), system, endpoint, bucket, prefix, str(n), str(workdir)]
    env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env, check=False)
    if out.returncode != 0:
        lines = [ln.strip() for ln in out.stderr.splitlines() if "Error" in ln or "error" in ln]
        return {"error": (lines[-1] if lines else f"exit {out.returncode}")[:300]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="800 records (100 MB), a smoke run")
    p.add_argument("--records", type=int, default=8000)
    p.add_argument("--records-per-shard", type=int, default=256, help="256 x 128 KiB = 32 MiB shards")
    p.add_argument("--latencies", default="0,20,50", help="added request latencies in ms")
    p.add_argument("--ram-fraction", type=float, default=0.25, help="RAM budget as a fraction of the dataset")
    p.add_argument("--sweep", default="", help="remote_gap_bytes values to sweep, e.g. 0,256KiB,1MiB,4MiB")
    p.add_argument("--peers", action="store_true", help="also MosaicML Streaming and LitData (bench venv)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--proxy", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.proxy:
        run_proxy(int(a.proxy[0]), int(a.proxy[1]), float(a.proxy[2]))
        return
    if a.quick:
        a.records, a.records_per_shard = 800, 100

    from shardkit.formats.publish import upload_dataset
    from shardkit.stores import open_store
    from shardkit.units import parse_bytes
    from tests.helpers.seaweed import SeaweedServer

    work = Path(tempfile.mkdtemp(prefix="shardkit-bench-remote-"))
    server = SeaweedServer(work / "seaweed").start()
    os.environ.update(server.env())
    results: dict[str, Any] = {"records": a.records, "record_bytes": int(np.prod(RECORD_SHAPE)), "latencies": {}}
    try:
        local = make_dataset(work / "ds", a.records, a.records_per_shard)
        url = f"s3://{server.bucket}/bench"
        upload_dataset(local, url)
        keys = [m.key for m in open_store(url).list("image")]
        data_mb = a.records * int(np.prod(RECORD_SHAPE)) / 1e6
        ram = int(a.ram_fraction * a.records) * int(np.prod(RECORD_SHAPE))
        print(f"dataset: {a.records} x 128 KiB = {data_mb:.0f} MB in {len(keys)} shards; RAM budget {ram / 1e6:.0f} MB")
        for lat in [float(x) for x in a.latencies.split(",")]:
            proxy = DelayProxy(server.port, lat) if lat else None
            os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint if proxy else server.endpoint
            row: dict[str, Any] = {}
            try:
                raw = max(raw_whole_objects(url, keys, c) for c in (8, 16, 32))
                row["raw MB/s"] = raw
                ssd = work / "ssd"
                ssd.mkdir(exist_ok=True)
                for tiers in ("ram", "ram,ssd"):
                    r = shardkit_epoch(url, tiers, ram, ssd, cache_dir=None)  # ranged reads (no default cache)
                    r["ratio"] = r["MB/s"] / raw
                    row[f"shardkit {tiers}"] = r
                    # The same with the local disk as the cache of whole shards (cold: emptied first).
                    cache = work / "cache"
                    shutil.rmtree(cache, ignore_errors=True)
                    cache.mkdir()
                    r = shardkit_epoch(url, tiers, ram, ssd, cache_dir=cache)
                    r["ratio"] = r["MB/s"] / raw
                    row[f"shardkit {tiers} +cache cold"] = r
                    r = shardkit_epoch(url, tiers, ram, ssd, cache_dir=cache)  # a later epoch: all local
                    r["ratio"] = r["MB/s"] / raw
                    row[f"shardkit {tiers} +cache warm"] = r
                for g in [x for x in a.sweep.split(",") if x]:
                    r = shardkit_epoch(url, "ram", ram, ssd, remote_gap_bytes=parse_bytes(g, what="--sweep", allow_zero=True),
                                       cache_dir=None)
                    r["ratio"] = r["MB/s"] / raw
                    row[f"gap {g}"] = r
                if a.peers:
                    for system in ("streaming", "litdata"):
                        r = peer(system, os.environ["AWS_ENDPOINT_URL"], server.bucket, f"peer-{system}", a.records,
                                 work / f"peer-{system}-{lat:g}")
                        if "MB/s" in r:
                            r["ratio"] = r["MB/s"] / raw
                        row[system] = r
            finally:
                if proxy:
                    proxy.close()
            results["latencies"][f"{lat:g} ms"] = row
            print(f"\n+{lat:g} ms: raw {row['raw MB/s']:.0f} MB/s")
            for name, r in row.items():
                if isinstance(r, dict):
                    if "error" in r:
                        print(f"  {name:<28} error: {r['error']}")
                        continue
                    extra = f", {r['requests']} requests, {r['fetched_MB']:.0f} MB fetched" if "requests" in r else ""
                    print(f"  {name:<28} {r['MB/s']:7.0f} MB/s  ratio {r['ratio']:.2f}{extra}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
