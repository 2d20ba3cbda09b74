"""Image codecs per record (issue 36): which library, what ratio and quality, and what the loader costs.

Three measurements, each printed as a table (``--json FILE`` also writes them):

1. ``libraries``: encode and decode CPU time per 224x224x3 image for the JPEG libraries installed
   (imagecodecs, simplejpeg, PyTurboJPEG, Pillow), quality 90, on photographs from ``datasets/``.
   CPU time (``time.process_time``) survives a loaded machine better than wall time.
2. ``quality``: stored/decoded ratio and PSNR of every image option on the bundled COCO images, the
   class-folder images, and ``--images`` generated photograph-like images (random crops of the bundled
   photos at random scales, flipped, resized to 224x224: real image statistics, not noise).
3. ``loader``: decoded records/s of the sampler (RAM tier, no static cache, page cache warm) with
   ``decode_workers=--workers`` against imagecodecs decoding the same stored bytes from memory on as
   many threads, interleaved for ``--rounds`` rounds; the ratio is what the loader keeps. Both sides
   are timed warm, as a training run sees them: the library decodes into an output buffer it used
   before, the sampler's second epoch of three is timed (its batch buffers and threads made in the
   first). ``library_paged`` columns: the library decoding into page-aligned rows, as the sampler's
   batch rows are (libjpeg-turbo writes a row on a 16/32-byte boundary with non-temporal stores, a
   row 16 bytes past one with ordinary stores). ``first_epoch`` columns time a fresh sampler's one epoch (the measure
   before: its start, threads and the batch buffers' first pages included, a fixed cost that a
   2,000-record epoch does not amortise). The sampler's CPU per record is also split by stage
   (reading thread, consumer, decoders and the rest).
   Peer row, when ``--streaming-python`` (default: this interpreter) imports mosaicml-streaming:
   Streaming's ``jpeg`` MDS decode (PIL) of the same bytes on as many threads, and StreamingDataset
   reading an MDS copy of them in one process (``benchmarks/_streaming_decode.py``), in the same rounds.

4. ``remote`` (only with ``--remote``): the same generated images stored as jpeg:90 and decoded,
   uploaded to a local SeaweedFS behind ``benchmarks/remote.py``'s latency proxy (its server and proxy,
   reused), each read for one epoch by the sampler without a local cache (``cache_dir=None``: every
   byte crosses the proxy) at ``--latency`` ms added per request; records/s of each, the raw GET of
   the same round (network bytes/s), and the model records/s = min(network bytes/s / stored record
   bytes, decode records/s per core x cores), the decode rate from the CPU time measured here.

    python benchmarks/record_codecs.py [--images 2000] [--rounds 3] [--workers 2] [--json out.json]
    python benchmarks/record_codecs.py --skip libraries,quality --streaming-python /work/benchvenv/bin/python
    python benchmarks/record_codecs.py --remote --skip libraries,quality,loader --latency 20 --images 1000
"""

from __future__ import annotations

import argparse
import io
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from shardkit.formats import DatasetWriter, FieldSpec, open_dataset
from shardkit.formats.codecs import get_codec
from shardkit.formats.reader import aligned_empty
from shardkit.readers import TieredSampler

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "benchmarks")):  # tests.helpers.seaweed and benchmarks/remote.py (--remote)
    if _p not in sys.path:
        sys.path.insert(0, _p)
SIDE = 224
OPTIONS = ("jpeg:90", "jpeg:75", "webp:90", "jpegxl:90", "png", "webp:lossless", "jpegxl:lossless", "zstd")


def _square(im: Image.Image, side: int = SIDE) -> np.ndarray:
    w, h = im.size
    s = min(w, h)
    box = ((w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s)
    return np.ascontiguousarray(np.asarray(im.convert("RGB").crop(box).resize((side, side), Image.BILINEAR)))


def folder_images(folder: Path) -> np.ndarray:
    """Every JPEG under ``folder``, centre-cropped and resized to 224x224 RGB."""
    out = []
    for f in sorted(folder.rglob("*.jpg")):
        with Image.open(f) as im:
            out.append(_square(im))
    return np.stack(out)


def generated_images(n: int, seed: int = 0) -> np.ndarray:
    """``n`` photograph-like images: random crops (25-100% of the short side) of the bundled photos."""
    rng = np.random.default_rng(seed)
    photos = [Image.open(f).convert("RGB") for f in sorted((ROOT / "datasets").rglob("*.jpg"))]
    out = np.empty((n, SIDE, SIDE, 3), np.uint8)
    for i in range(n):
        im = photos[int(rng.integers(len(photos)))]
        w, h = im.size
        s = int(min(w, h) * rng.uniform(0.25, 1.0))
        x, y = int(rng.integers(0, w - s + 1)), int(rng.integers(0, h - s + 1))
        a = np.asarray(im.crop((x, y, x + s, y + s)).resize((SIDE, SIDE), Image.BILINEAR))
        out[i] = a[:, ::-1] if rng.integers(2) else a
    return out


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def libraries(images: np.ndarray, quality: int = 90, repeats: int = 5) -> list[dict[str, Any]]:
    """Encode / decode CPU µs per image for each installed JPEG library (decoding into a given buffer
    where the library can)."""
    libs: dict[str, tuple[Callable[[np.ndarray], bytes], Callable[[bytes, np.ndarray], Any]]] = {}
    try:
        import imagecodecs

        libs["imagecodecs"] = (lambda a: imagecodecs.jpeg8_encode(a, level=quality),
                               lambda b, out: imagecodecs.jpeg8_decode(b, out=out))
    except ImportError:
        pass
    try:
        import simplejpeg

        libs["simplejpeg"] = (lambda a: simplejpeg.encode_jpeg(a, quality=quality, colorsubsampling="420"),
                              lambda b, out: simplejpeg.decode_jpeg(b, buffer=out))
    except ImportError:
        pass
    try:
        import turbojpeg

        tj = turbojpeg.TurboJPEG()
        libs["pyturbojpeg"] = (lambda a: tj.encode(a, quality=quality, pixel_format=turbojpeg.TJPF_RGB),
                               lambda b, out: out.__setitem__(Ellipsis, tj.decode(b, pixel_format=turbojpeg.TJPF_RGB)))
    except Exception:  # not installed, or its native library missing
        pass

    def pil_encode(a: np.ndarray) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, "JPEG", quality=quality)
        return buf.getvalue()

    def pil_decode(b: bytes, out: np.ndarray) -> None:
        with Image.open(io.BytesIO(b)) as im:
            out[...] = np.asarray(im.convert("RGB"))

    libs["pillow"] = (pil_encode, pil_decode)
    rows = []
    out = np.empty(images.shape[1:], np.uint8)
    for name, (enc, dec) in libs.items():
        t = time.process_time()
        for _ in range(repeats):
            blobs = [enc(a) for a in images]
        t_enc = (time.process_time() - t) / (repeats * len(images))
        t = time.process_time()
        for _ in range(repeats * 3):
            for b in blobs:
                dec(b, out)
        t_dec = (time.process_time() - t) / (repeats * 3 * len(images))
        rows.append({"library": name, "encode_us": round(t_enc * 1e6), "decode_us": round(t_dec * 1e6),
                     "ratio": round(images.nbytes / sum(map(len, blobs)), 2)})
    return rows


def quality(sets: dict[str, np.ndarray], options: tuple[str, ...] = OPTIONS) -> list[dict[str, Any]]:
    """Ratio, mean and lowest PSNR of every option on every image set."""
    rows = []
    for option in options:
        codec = get_codec(option)
        assert codec is not None
        for name, images in sets.items():
            stored, scores = 0, []
            out = np.empty(images.shape[1:], np.uint8)
            t = time.process_time()
            for a in images:
                blob = codec.encode(a)
                stored += len(blob)
                codec.decode(blob, out)
                scores.append(_psnr(a, out))
            finite = [s for s in scores if math.isfinite(s)]
            rows.append({"option": option, "set": name, "images": len(images), "ratio": round(images.nbytes / stored, 2),
                         "psnr_db": round(float(np.mean(finite)), 2) if finite else None,
                         "min_psnr_db": round(min(finite), 2) if finite else None,
                         "cpu_ms_per_image": round((time.process_time() - t) / len(images) * 1e3, 2)})
    return rows


def streaming_available(python: str) -> bool:
    """True when ``python`` imports mosaicml-streaming (the peer row runs in that interpreter)."""
    import subprocess

    try:
        # find_spec, not import: importing streaming imports torch, minutes on a loaded machine
        check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('streaming') is None)"
        return subprocess.run([python, "-c", check], capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def streaming_round(python: str, blobs_file: Path, workers: int, work: Path) -> dict[str, Any]:
    """One round of the peer row: benchmarks/_streaming_decode.py's JSON (Streaming's decode rates)."""
    import subprocess

    cmd = [python, str(ROOT / "benchmarks" / "_streaming_decode.py"), str(blobs_file), "--threads", str(workers),
           "--dataset", str(work / "streaming")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {run.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def loader(images: np.ndarray, workers: int, rounds: int, work: Path, streaming_python: str | None = None) -> dict[str, Any]:
    """Sampler decoded records/s with ``workers`` decode threads vs imagecodecs on ``workers`` threads
    (and Streaming's PIL decode of the same bytes when ``streaming_python`` is given)."""
    import imagecodecs

    path = work / "jpeg"
    with DatasetWriter(path, kind="bench", payload="image", record=FieldSpec(images.shape[1:], "uint8"),
                       compression="jpeg:90") as w:
        for a in range(0, len(images), 256):
            w.write({"image": images[a : a + 256]})
    with open_dataset(path) as ds:
        blobs = []
        for i, info in enumerate(ds.meta.shards):
            idx = ds.payload.index(i)
            data = ds.payload.shard_path(i).read_bytes()
            blobs += [data[int(o) : int(o) + int(n)] for o, n in zip(idx.offsets[: info.count], idx.nbytes[: info.count])]
    n = len(blobs)
    out = np.empty((256, *images.shape[1:]), np.uint8)
    # The same rows page aligned, as the sampler's batch buffers are: libjpeg-turbo writes a row that
    # starts on a 16/32-byte boundary with non-temporal stores (np.empty's rows start 16 bytes past one).
    paged = aligned_empty(256, images.shape[1:], np.dtype(np.uint8))

    def library(rows: np.ndarray = out) -> tuple[float, float]:
        def job(a: int) -> None:
            for j in range(a, min(a + 8, n)):
                imagecodecs.jpeg8_decode(blobs[j], out=rows[j % 256])

        t, c = time.perf_counter(), time.process_time()
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(job, range(0, n, 8)))
        return n / (time.perf_counter() - t), (time.process_time() - c) / n

    def sampler_epoch(it: Iterator[dict[str, Any]], s: TieredSampler) -> tuple[float, float, dict[str, float]]:
        """One epoch (``n`` records) of ``it``: records/s and CPU s per record, and the CPU per record by
        stage: the reading thread (its busy CPU in the sampler's stats), the consumer (this thread),
        the rest (the decode threads, and the pipeline's other threads)."""
        read0 = s.stats.busy_seconds.get("disk_cpu", 0.0)
        t, c, m = time.perf_counter(), time.process_time(), time.thread_time()
        got = 0
        while got < n:
            got += len(next(it)["key"])
        rate, cpu = got / (time.perf_counter() - t), (time.process_time() - c) / got
        main = (time.thread_time() - m) / got
        read = (s.stats.busy_seconds.get("disk_cpu", 0.0) - read0) / got
        return rate, cpu, {"read": read, "consumer": main, "decode_and_rest": cpu - read - main}

    def first_epoch() -> tuple[float, float]:
        """A fresh sampler's one epoch: records/s and CPU s per record, its start (pipeline threads,
        first block, batch buffers' first pages) included."""
        s = TieredSampler(path, batch_size=256, static_cache=0, decode_workers=workers, seed=1)
        rate, cpu, _ = sampler_epoch(iter(s), s)
        s.close()
        return rate, cpu

    def steady_epoch() -> tuple[float, float, dict[str, float]]:
        """Steady state, what a training run sees epoch after epoch: the middle epoch of a 3-epoch
        sampler (its batch buffers and threads made in the first; it reads ahead into the third as
        much as it read into it from the first, so the epoch timed is an epoch's work)."""
        s = TieredSampler(path, batch_size=256, static_cache=0, decode_workers=workers, seed=1, epochs=3)
        it = iter(s)
        sampler_epoch(it, s)
        got = sampler_epoch(it, s)
        s.close()
        return got

    blobs_file = work / "jpeg90-blobs.npz"
    if streaming_python is not None:
        lengths = np.array([len(b) for b in blobs], np.int64)
        np.savez(blobs_file, data=np.frombuffer(b"".join(blobs), np.uint8), offsets=np.concatenate([[0], np.cumsum(lengths)]))
    first_epoch()  # warm: page cache, imports
    library()  # warm: the library's output buffer (as the steady sampler's batch buffers)
    library(paged)
    rounds_out = []
    for _ in range(rounds):
        lib_rate, lib_cpu = library()
        paged_rate, paged_cpu = library(paged)
        smp_rate, smp_cpu, stages = steady_epoch()
        first_rate, first_cpu = first_epoch()
        row = {"library_rps": round(lib_rate), "sampler_rps": round(smp_rate), "ratio": round(smp_rate / lib_rate, 3),
               "first_epoch_rps": round(first_rate), "first_epoch_ratio": round(first_rate / lib_rate, 3),
               "library_cpu_us": round(lib_cpu * 1e6), "sampler_cpu_us": round(smp_cpu * 1e6),
               "library_paged_rps": round(paged_rate), "library_paged_cpu_us": round(paged_cpu * 1e6),
               "first_epoch_cpu_us": round(first_cpu * 1e6),
               **{f"sampler_{k}_us": round(v * 1e6) for k, v in stages.items()}}
        if streaming_python is not None:
            peer = streaming_round(streaming_python, blobs_file, workers, work)
            row.update({"streaming_decode_rps": peer["decode"]["rps"], "streaming_decode_cpu_us": peer["decode"]["cpu_us"],
                        "streaming_dataset_rps": peer["dataset"]["rps"], "streaming_dataset_cpu_us": peer["dataset"]["cpu_us"]})
        rounds_out.append(row)
    ratios = [r["ratio"] for r in rounds_out]
    firsts = [r["first_epoch_ratio"] for r in rounds_out]
    return {"records": n, "workers": workers, "stored_bytes": sum(map(len, blobs)), "rounds": rounds_out,
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratio_median": float(np.median(ratios)), "first_epoch_ratio_median": float(np.median(firsts)),
            "first_epoch_ratio_min": min(firsts), "first_epoch_ratio_max": max(firsts)}


def _write(path: Path, images: np.ndarray, compression: str | None) -> Path:
    with DatasetWriter(path, kind="bench", payload="image", record=FieldSpec(images.shape[1:], "uint8"),
                       compression=compression, records_per_shard=256) as w:
        for a in range(0, len(images), 256):
            w.write({"image": images[a : a + 256]})
    return path


def _remote_epoch(url: str, proxy: Any, workers: int) -> dict[str, Any]:
    """One epoch of the sampler over ``url`` through ``proxy`` (no local cache): records/s, CPU µs per
    record, and the bytes and requests the proxy relayed."""
    from _remote_peers import counter_delta

    s = TieredSampler(url, batch_size=64, static_cache=0, cache_dir=None, decode_workers=workers, seed=1)
    before = proxy.counters()
    t, c = time.perf_counter(), time.process_time()
    got = sum(len(b["key"]) for b in s)
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    s.close()
    d = counter_delta(before, proxy.counters())
    return {"rps": round(got / dt), "cpu_us": round(cpu / got * 1e6), "fetched_MB": round(d["bytes"] / 1e6, 1),
            "requests": d["requests"]}


def remote(images: np.ndarray, workers: int, rounds: int, latency_ms: float, work: Path) -> dict[str, Any]:
    """jpeg:90 against decoded records through the object store at ``latency_ms`` added per request
    (benchmarks/remote.py's SeaweedFS and delay proxy), interleaved for ``rounds`` rounds, with the
    raw GET of each round and the decode rate per core measured on the same bytes."""
    import os

    import imagecodecs
    from remote import DelayProxy, raw_get  # benchmarks/remote.py: its server, proxy and raw GET

    from shardkit.formats.transfer import upload_dataset
    from shardkit.stores import open_store
    from tests.helpers.seaweed import SeaweedServer

    server = SeaweedServer(work / "seaweed").start()
    proxy = None
    try:
        os.environ.update(server.env())
        urls = {}
        for name, compression in (("jpeg:90", "jpeg:90"), ("decoded", None)):
            local = _write(work / name.replace(":", ""), images, compression)
            urls[name] = f"s3://{server.bucket}/{local.name}"
            upload_dataset(local, urls[name])
        stored = {}
        for name in urls:
            with open_dataset(work / name.replace(":", "")) as ds:
                stored[name] = sum(s.nbytes for s in ds.meta.shards) / ds.num_records
        with open_dataset(work / "jpeg90") as ds:
            blobs = [bytes(ds.payload.shard_path(i).read_bytes()[int(o) : int(o) + int(n)])
                     for i, info in enumerate(ds.meta.shards)
                     for o, n in zip(ds.payload.index(i).offsets[: info.count], ds.payload.index(i).nbytes[: info.count])]
        out = np.empty(images.shape[1:], np.uint8)
        c = time.process_time()
        for b in blobs:
            imagecodecs.jpeg8_decode(b, out=out)
        decode_us = (time.process_time() - c) / len(blobs) * 1e6
        proxy = DelayProxy(server.port, latency_ms)
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
        rows = []
        for rnd in range(1, rounds + 1):
            keys = {name: [m.key for m in open_store(url).list("image")] for name, url in urls.items()}
            raw = raw_get(urls["decoded"], keys["decoded"], proxy)
            row: dict[str, Any] = {"round": rnd, "raw_MB/s": round(raw["MB/s"])}
            for name, url in urls.items():
                m = _remote_epoch(url, proxy, workers)
                row.update({f"{name} rps": m["rps"], f"{name} cpu_us": m["cpu_us"], f"{name} MB": m["fetched_MB"],
                            f"{name} requests": m["requests"]})
            row["ratio"] = round(row["jpeg:90 rps"] / row["decoded rps"], 2)
            rows.append(row)
            print("  " + "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    finally:
        if proxy is not None:
            proxy.close()
        server.stop()
    net = float(np.median([r["raw_MB/s"] for r in rows])) * 1e6
    per_core = 1e6 / decode_us

    def model(cores: int) -> dict[str, float]:
        jpeg = min(net / stored["jpeg:90"], per_core * cores)
        decoded = net / stored["decoded"]
        return {"cores": cores, "jpeg_rps": round(jpeg), "decoded_rps": round(decoded), "ratio": round(jpeg / decoded, 2),
                "limit": "decode" if per_core * cores < net / stored["jpeg:90"] else "network"}

    # Decoding stops being the limit once decode capacity >= network bytes/s / stored jpeg bytes;
    # jpeg is >= 2x decoded storage while cores x per-core rate >= 2 x network / decoded record bytes.
    return {"latency_ms": latency_ms, "records": len(images), "workers": workers, "rounds": rows,
            "stored_bytes_per_record": {k: round(v) for k, v in stored.items()}, "decode_us_per_core": round(decode_us),
            "cores_for_2x": round(2 * net / stored["decoded"] / per_core, 2),
            "model": [model(2), model(16)]}


def _table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    width = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    lines = ["  ".join(k.ljust(width[k]) for k in keys)]
    lines += ["  ".join(str(r[k]).ljust(width[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000, help="generated photograph-like images (default 2000)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved loader rounds (default 3)")
    ap.add_argument("--workers", type=int, default=2, help="decode threads on both sides (default 2)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: libraries, quality, loader")
    ap.add_argument("--options", default=",".join(OPTIONS),
                    help="comma-separated --compression values to measure (jpegxl:lossless takes seconds per image)")
    ap.add_argument("--remote", action="store_true", help="also measure through the object store (SeaweedFS + delay proxy)")
    ap.add_argument("--latency", type=float, default=20.0, help="added ms per request with --remote (default 20)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--streaming-python", default=sys.executable,
                    help="interpreter with mosaicml-streaming for the loader's peer row (default: this one; "
                         "the row is left out when it cannot import streaming)")
    args = ap.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    results: dict[str, Any] = {}
    coco, folders = folder_images(ROOT / "datasets" / "coco"), folder_images(ROOT / "datasets" / "imagefolder")
    generated = generated_images(args.images)
    if "libraries" not in skip:
        results["libraries"] = libraries(np.concatenate([coco, folders]))
        print("JPEG libraries, quality 90, CPU time per 224x224x3 image\n" + _table(results["libraries"]) + "\n")
    if "quality" not in skip:
        options = tuple(o.strip() for o in args.options.split(",") if o.strip())
        results["quality"] = quality({"coco": coco, "class-folders": folders, "generated": generated}, options)
        print("ratio and PSNR per option\n" + _table(results["quality"]) + "\n")
    if "loader" not in skip:
        work = Path(tempfile.mkdtemp(prefix="shardkit-codecs-"))
        try:
            peer = args.streaming_python if streaming_available(args.streaming_python) else None
            if peer is None:
                print(f"loader: no Streaming row ({args.streaming_python} cannot import streaming)", flush=True)
            results["loader"] = loader(generated, args.workers, args.rounds, work, peer)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        lo = results["loader"]
        print(f"loader: {lo['records']} jpeg:90 records, {lo['workers']} decode threads\n" + _table(lo["rounds"]))
        print(f"sampler / library: median {lo['ratio_median']:.3f}, range {lo['ratio_min']:.3f}-{lo['ratio_max']:.3f} "
              f"(a fresh sampler's first epoch: median {lo['first_epoch_ratio_median']:.3f}, "
              f"range {lo['first_epoch_ratio_min']:.3f}-{lo['first_epoch_ratio_max']:.3f})")
    if args.remote:
        work = Path(tempfile.mkdtemp(prefix="shardkit-codecs-remote-"))
        try:
            print(f"object store: {len(generated)} records, jpeg:90 and decoded, +{args.latency:g} ms per request", flush=True)
            results["remote"] = re = remote(generated, args.workers, args.rounds, args.latency, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"stored bytes per record {re['stored_bytes_per_record']}; imagecodecs decode {re['decode_us_per_core']} us "
              f"per record per core; jpeg is >= 2x decoded storage with >= {re['cores_for_2x']} cores of decoding")
        print("model: records/s = min(network bytes/s / stored record bytes, decode rate x cores)\n" + _table(re["model"]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
