"""Image codecs per record (issue 36): which library, what ratio and quality, and what the loader costs.

Three measurements, each printed as a table (``--json FILE`` also writes them):

1. ``libraries``: encode and decode CPU time per 224x224x3 image for the JPEG libraries installed
   (imagecodecs, simplejpeg, PyTurboJPEG, Pillow), quality 90, on photographs from ``datasets/``.
   CPU time (``time.process_time``) survives a loaded machine better than wall time.
2. ``quality``: stored/decoded ratio and PSNR of every image option on the bundled COCO images, the
   class-folder images, and ``--images`` generated photograph-like images (random crops of the bundled
   photos at random scales, flipped, resized to 224x224: real image statistics, not noise).
3. ``loader``: decoded records/s of the sampler (one epoch, RAM tier, no static cache, page cache
   warm) with ``decode_workers=--workers`` against imagecodecs decoding the same stored bytes from
   memory on as many threads, interleaved for ``--rounds`` rounds; the ratio is what the loader keeps.

    python benchmarks/record_codecs.py [--images 2000] [--rounds 3] [--workers 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from shardkit.formats import DatasetWriter, FieldSpec, open_dataset
from shardkit.formats.codecs import get_codec
from shardkit.readers import TieredSampler

ROOT = Path(__file__).resolve().parents[1]
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


def loader(images: np.ndarray, workers: int, rounds: int, work: Path) -> dict[str, Any]:
    """Sampler decoded records/s with ``workers`` decode threads vs imagecodecs on ``workers`` threads."""
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

    def library() -> tuple[float, float]:
        def job(a: int) -> None:
            for j in range(a, min(a + 8, n)):
                imagecodecs.jpeg8_decode(blobs[j], out=out[j % 256])

        t, c = time.perf_counter(), time.process_time()
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(job, range(0, n, 8)))
        return n / (time.perf_counter() - t), (time.process_time() - c) / n

    def sampler() -> tuple[float, float]:
        s = TieredSampler(path, batch_size=256, static_cache=0, decode_workers=workers, seed=1)
        t, c = time.perf_counter(), time.process_time()
        got = sum(len(b["key"]) for b in s)
        rate, cpu = got / (time.perf_counter() - t), (time.process_time() - c) / got
        s.close()
        return rate, cpu

    sampler()  # warm: page cache, imports
    rounds_out = []
    for _ in range(rounds):
        lib_rate, lib_cpu = library()
        smp_rate, smp_cpu = sampler()
        rounds_out.append({"library_rps": round(lib_rate), "sampler_rps": round(smp_rate), "ratio": round(smp_rate / lib_rate, 3),
                           "library_cpu_us": round(lib_cpu * 1e6), "sampler_cpu_us": round(smp_cpu * 1e6)})
    ratios = [r["ratio"] for r in rounds_out]
    return {"records": n, "workers": workers, "rounds": rounds_out, "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratio_median": float(np.median(ratios))}


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
    ap.add_argument("--json", type=Path, help="also write the results here")
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
            results["loader"] = loader(generated, args.workers, args.rounds, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        lo = results["loader"]
        print(f"loader: {lo['records']} jpeg:90 records, {lo['workers']} decode threads\n" + _table(lo["rounds"]))
        print(f"sampler / library: median {lo['ratio_median']:.3f}, range {lo['ratio_min']:.3f}-{lo['ratio_max']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
