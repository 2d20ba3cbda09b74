"""Scale-out of conversion in parts: a local pool, a Dask cluster of 1 and 2 workers, the commit, appends,
and a model of 16 to 256 workers against a shared store of fixed bandwidth.

Measured in one run on this machine:

1. **Throughput** on N JPEGs (~500x375 -> 224x224, the corpus of ``benchmarks/convert.py``), page
   cache dropped before each pass: one process (the baseline), today's local pool (``--workers 2``),
   the same corpus in parts on a local ``ProcessPoolExecutor(2)`` (how issue 15 would run a local
   conversion: the parent only plans and commits), and on a real Dask cluster of 1 and of 2 workers
   (``dask scheduler`` + ``dask worker --nworkers 1 --nthreads 1`` on loopback). records/s and the
   ratio to one process; every variant's shards are checked byte-identical to the baseline's.
2. **Commit** time and bytes re-packed against dataset size, with a synthetic kind whose "decode" is
   free (so the numbers are the commit's) and parts deliberately misaligned with the shards: the
   re-packed bytes must stay at most one shard per part, whatever the dataset size.
3. **Append** cost: appending 1/8 more records to a dataset against converting everything again.
4. **Model**: the measured per-record decode cost, per-part overhead and commit costs, projected to
   16..256 workers converting ImageNet-21k (14.2 M images) against a shared store of fixed bandwidth
   (``--store-gbps``) with the commit on one client (``--client-gbps``): where scaling stops, and why.

Prints markdown tables (record them in RESULTS.md). ``--quick`` is a small smoke run.

Usage: ``python benchmarks/scaleout.py [--images 1200] [--quick] [--store-gbps 10] [--client-gbps 1.25]``
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from _common import drop_cache
from convert import DATA, SIZE, make_corpus

import shardkit
from shardkit.converters import Converter, Decoded, Decoder, ScanResult, register
from shardkit.converters.executors import InlineExecutor
from shardkit.formats import FieldSpec, open_dataset
from shardkit.formats.spec import INDEX_ENTRY_NBYTES

REPO = Path(__file__).resolve().parents[1]
RECORD = (224, 224, 3)
RECORD_NBYTES = int(np.prod(RECORD))


# ---------------------------------------------------------------------- a kind with free decoding
class NoiseDecoder(Decoder):
    """Record ``i`` of the ``bench-noise`` kind: one of 64 random images with its first bytes set to ``i``."""

    def __init__(self) -> None:
        super().__init__("image", FieldSpec(RECORD, "uint8"))
        self.patterns = np.random.default_rng(0).integers(0, 256, (64, *RECORD), dtype=np.uint8)

    def decode(self, item: int, start: int = 0) -> Decoded:
        rec = self.patterns[item % 64].copy()
        rec.reshape(-1)[:8] = np.frombuffer(np.int64(item).tobytes(), np.uint8)
        return Decoded([{"image": rec, "label": np.int64(item % 1000)}])

    def item_path(self, item: int) -> str:
        return f"noise/{item}"


class Noise(Converter):
    """``N`` records from numbers (the corpus is a file holding N): conversions that only write."""

    name = "bench-noise"
    payload = "image"
    options: ClassVar[tuple[Any, ...]] = ()
    one_record_per_input = True

    @classmethod
    def detect(cls, src: Path) -> bool:
        return False

    def scan(self) -> ScanResult:
        first, count = (int(x) for x in self.src.read_text().split())
        return ScanResult(range(first, first + count))

    def record_spec(self) -> FieldSpec:
        return FieldSpec(RECORD, "uint8")

    def fields(self) -> dict[str, FieldSpec]:
        return {"label": FieldSpec((), "int64")}

    def labels(self) -> dict[str, list[str]]:
        return {}

    def make_decoder(self) -> Decoder:
        return NoiseDecoder()


def noise_corpus(path: Path, first: int, count: int) -> Path:
    path.write_text(f"{first} {count}\n")
    return path


# ---------------------------------------------------------------------- 1. throughput
def same_shards(a: Path, b: Path) -> bool:
    with open_dataset(a) as x, open_dataset(b) as y:
        return x.meta.shards == y.meta.shards and all(
            x.payload.shard_path(i).read_bytes() == y.payload.shard_path(i).read_bytes() for i in range(len(x.meta.shards)))


def throughput(tmp: Path, images: int, part_size: int) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO))
    from tests.helpers.dask_cluster import DaskCluster

    files = make_corpus(images)
    rows: list[dict[str, Any]] = []

    def run(name: str, out: Path, **kw: Any) -> None:
        drop_cache(files)
        t0 = time.perf_counter()
        s = shardkit.convert(DATA, out, kind="imagefolder", size=SIZE, **kw)
        dt = time.perf_counter() - t0
        rows.append({"variant": name, "records": s.records, "seconds": dt, "parts": s.parts,
                     "commit_s": s.commit.seconds if s.commit else None,
                     "repacked": s.commit.bytes_repacked if s.commit else None, "out": out})

    run("one process (--workers 1)", tmp / "w1", workers=1)
    run("local pool today (--workers 2)", tmp / "w2", workers=2)
    with ProcessPoolExecutor(2) as pool:
        pool.submit(len, [1]).result()  # processes started outside the timed region
        run("parts on a local ProcessPoolExecutor(2)", tmp / "pp2", executor=pool, part_size=part_size)
    cluster = DaskCluster(tmp / "dask", workers=1)
    try:
        run("parts on Dask, 1 worker", tmp / "d1", scheduler=cluster.address, part_size=part_size)
        cluster.start_worker(1)
        run("parts on Dask, 2 workers", tmp / "d2", scheduler=cluster.address, part_size=part_size)
    finally:
        cluster.close()
    for row in rows:
        row["same"] = same_shards(row["out"], tmp / "w1")
    return rows


# ---------------------------------------------------------------------- 2. commit vs size
def commit_scaling(tmp: Path, sizes: list[int], shard_records: int) -> list[dict[str, Any]]:
    rows = []
    shard_bytes = shard_records * (RECORD_NBYTES + INDEX_ENTRY_NBYTES)
    for n in sizes:
        out = tmp / f"commit-{n}"
        part = 3 * shard_records + 7  # never a multiple of the shard: every part boundary is re-packed
        s = shardkit.convert(noise_corpus(tmp / f"noise-{n}", 0, n), out, kind="bench-noise", shard_bytes=shard_bytes,
                             executor=InlineExecutor(), part_size=part, workers=1)
        c = s.commit
        assert c is not None
        bound = s.parts * shard_bytes
        rows.append({"records": n, "payload": n * RECORD_NBYTES, "parts": s.parts, "shards": c.shards_in_place
                     + c.shards_linked + c.shards_repacked, "repacked_shards": c.shards_repacked,
                     "repacked": c.bytes_repacked, "bound": bound, "commit_s": c.seconds})
        shutil.rmtree(out)
    return rows


# ---------------------------------------------------------------------- 3. append vs everything again
def append_cost(tmp: Path, n: int, shard_records: int) -> dict[str, float]:
    shard_bytes = shard_records * (RECORD_NBYTES + INDEX_ENTRY_NBYTES)
    more = max(1, n // 8)
    kw: dict[str, Any] = dict(kind="bench-noise", workers=1)
    shardkit.convert(noise_corpus(tmp / "base", 0, n), tmp / "grown", shard_bytes=shard_bytes, **kw)
    drop_cache(tmp / "grown")
    t0 = time.perf_counter()
    s = shardkit.convert(noise_corpus(tmp / "more", n, more), tmp / "grown", append=True, **kw)
    t_append = time.perf_counter() - t0
    t0 = time.perf_counter()
    shardkit.convert(noise_corpus(tmp / "all", 0, n + more), tmp / "again", shard_bytes=shard_bytes, **kw)
    t_again = time.perf_counter() - t0
    assert s.commit is not None
    return {"base": n, "added": more, "append_s": t_append, "again_s": t_again,
            "repacked": s.commit.bytes_repacked, "commit_s": s.commit.seconds}


# ---------------------------------------------------------------------- 4. model
def model(per_record_s: float, part_overhead_s: float, repack_bps: float, in_bytes: float, *, store_gbps: float,
          client_gbps: float, records: int = 14_197_122) -> list[dict[str, Any]]:
    """Projected conversion of ``records`` images by W workers sharing one store.

    Each record is read from the store (``in_bytes``, the JPEG) and written once (150,528 bytes); a
    worker decodes ``1 / per_record_s`` records/s; parts (the default plan: 16 shards of 256 MiB)
    add ``part_overhead_s`` each and run in waves of W. The commit re-packs at most one shard per
    part, as tasks on the same W workers (each at the measured ``repack_bps``, all together at most
    half the store's bandwidth: every byte is read and written), then the client writes the fields
    (8 bytes a record at ``client_gbps``).
    """
    shard = 1782  # records of 150,528 bytes in a default 256 MiB shard
    part = 16 * shard
    parts = math.ceil(records / part)
    store_bps = store_gbps * 1e9
    store = store_bps / (in_bytes + RECORD_NBYTES)  # records/s the store sustains
    repack_bytes = parts * shard * RECORD_NBYTES
    one = records * per_record_s + parts * part_overhead_s
    rows = []
    for w in (1, 16, 32, 64, 128, 256):
        waves = math.ceil(parts / w)  # parts are equal: the last wave may run with idle workers
        compute = waves * (part * per_record_s + part_overhead_s)
        io = records / store
        commit_s = repack_bytes / min(w * repack_bps, store_bps / 2) + records * 8 / (client_gbps * 1e9)
        t = max(compute, io) + commit_s
        if w == 1:
            one += commit_s
        rows.append({"workers": w, "compute_s": compute, "store_s": io, "commit_s": commit_s, "total_s": t,
                     "rate": records / t, "speedup": one / t,
                     "bound": "store" if io > compute else ("waves" if waves * w > parts * 1.1 else "decode")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1200)
    ap.add_argument("--quick", action="store_true", help="a small smoke run (a few minutes)")
    ap.add_argument("--store-gbps", type=float, default=10.0, help="shared store bandwidth of the model, GB/s")
    ap.add_argument("--client-gbps", type=float, default=1.25, help="bandwidth of the committing client, GB/s")
    args = ap.parse_args()
    images = 160 if args.quick else args.images
    sizes = [300, 600, 1200] if args.quick else [1000, 4000, 16000]
    shard_records = 32 if args.quick else 110  # ~4.8 MiB and ~16.5 MiB shards
    register(Noise, replace=True)
    tmp = Path(tempfile.mkdtemp(prefix="shardkit-bench-scaleout-"))
    try:
        rows = throughput(tmp, images, part_size=max(1, images // 8))
        commits = commit_scaling(tmp, sizes, shard_records)
        append = append_cost(tmp, sizes[-1], shard_records)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = rows[0]["records"] / rows[0]["seconds"]
    print(f"{images} JPEGs ~500x375 -> {SIZE}x{SIZE}; Python {platform.python_version()}, {os.cpu_count()} cores "
          "(shared with whatever else runs)\n")
    print("| variant | records/s | vs one process | parts | commit s | re-packed MiB | shards identical |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        rate = r["records"] / r["seconds"]
        commit = "" if r["commit_s"] is None else f"{r['commit_s']:.2f}"
        repacked = "" if r["repacked"] is None else f"{r['repacked'] / 2**20:.1f}"
        print(f"| {r['variant']} | {rate:.1f} | {rate / base:.2f}x | {r['parts'] or ''} | {commit} | {repacked} | {r['same']} |")
    print("\nCommit against dataset size (parts never aligned with shards; bound = parts x shard bytes):\n")
    print("| records | payload MiB | parts | shards | re-packed shards | re-packed MiB | bound MiB | re-packed / payload | commit s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in commits:
        print(f"| {c['records']} | {c['payload'] / 2**20:.0f} | {c['parts']} | {c['shards']} | {c['repacked_shards']} | "
              f"{c['repacked'] / 2**20:.1f} | {c['bound'] / 2**20:.1f} | {c['repacked'] / c['payload']:.2f} | {c['commit_s']:.2f} |")
        assert c["repacked"] <= c["bound"], c
    print(f"\nAppend {append['added']} records to {append['base']}: {append['append_s']:.2f} s (commit "
          f"{append['commit_s']:.2f} s, {append['repacked'] / 2**20:.1f} MiB re-packed) vs converting all "
          f"{append['base'] + append['added']} again: {append['again_s']:.2f} s "
          f"({append['again_s'] / append['append_s']:.1f}x)")
    d1 = next(r for r in rows if r["variant"] == "parts on Dask, 1 worker")
    per_record = rows[0]["seconds"] / rows[0]["records"]  # decoding one record on one core
    overhead = max(0.0, (d1["seconds"] - d1["records"] * per_record) / max(1, d1["parts"]))  # what a part adds
    biggest = commits[-1]
    repack_bps = biggest["repacked"] / max(biggest["commit_s"], 1e-6)
    in_bytes = float(np.mean([p.stat().st_size for p in sorted(DATA.rglob("*.jpg"))[:images]]))
    print(f"\nModel inputs (measured): {per_record * 1e3:.2f} ms to decode a record on one core, {overhead:.2f} s per part "
          f"on a Dask worker beyond that (scheduling, connection, manifests; includes the client's start-up in a "
          f"short run), commit re-packs at {repack_bps / 1e6:.0f} MB/s, {in_bytes / 1e3:.0f} kB per JPEG; "
          f"assumed: store {args.store_gbps} GB/s, committing client {args.client_gbps} GB/s.\n")
    print("| workers | decode-bound s | store-bound s | commit s | total s | records/s | speed-up | bound by |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for m in model(per_record, overhead, repack_bps, in_bytes, store_gbps=args.store_gbps, client_gbps=args.client_gbps):
        print(f"| {m['workers']} | {m['compute_s']:.0f} | {m['store_s']:.0f} | {m['commit_s']:.0f} | {m['total_s']:.0f} | "
              f"{m['rate']:.0f} | {m['speedup']:.1f}x | {m['bound']} |")
    stop = args.store_gbps * 1e9 / (in_bytes + RECORD_NBYTES) * per_record
    print(f"\nScaling stops near {stop:.0f} workers: beyond it the store's {args.store_gbps} GB/s (each record read as a "
          "JPEG and written as 150,528 bytes) caps the rate. Before that, waves of equal parts leave workers idle when "
          "the part count is not a multiple of W (about 500 default parts here), and the commit adds a tail: at most "
          "one shard per part re-packed by the workers, then the fields through the client.")


if __name__ == "__main__":
    main()
