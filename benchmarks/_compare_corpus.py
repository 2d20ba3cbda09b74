"""Corpus and per-format datasets for ``benchmarks/compare.py``.

One corpus of generated JPEGs in class folders, decoded once to 224x224 records, then written by each
loader's own writer (shardkit ``DatasetWriter`` or ``shardkit.convert``, ``webdataset.ShardWriter``,
``streaming.MDSWriter``) from the same decoded records in the same order, so record key k (storage
position) is the same picture in every format. The peers store raw uint8 bytes: nobody pays JPEG
decode at read time except the per-file baseline, whose job that is.

Everything is cached under ``benchmarks/_data/compare/`` with a manifest of the parameters; a change
of parameters rebuilds.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("compare")

SIZE = 224
RECORD_SHAPE = (SIZE, SIZE, 3)
RECORD_NBYTES = SIZE * SIZE * 3
#: Peer shard size: MosaicML's MDSWriter default (64 MiB); WebDataset shards are cut at the same
#: record count so both peers have the same shard structure (several shards per DataLoader worker).
PEER_SHARD_BYTES = 1 << 26


@dataclass(frozen=True)
class CorpusSpec:
    """Parameters of the generated JPEG corpus (any change regenerates it)."""

    n: int = 3000
    classes: int = 10
    width: int = 500
    height: int = 375
    quality: int = 90
    seed: int = 0
    version: int = 2


# ---------------------------------------------------------------------------------------------- JPEGs
def _smooth_noise(rng: np.random.Generator, h: int, w: int, cell: int) -> np.ndarray:
    """Value noise: random values on a coarse grid, bilinearly upsampled (soft natural texture)."""
    from PIL import Image

    gh, gw = max(2, h // cell + 2), max(2, w // cell + 2)
    coarse = rng.random((gh, gw), dtype=np.float32)
    img = Image.fromarray(coarse, mode="F").resize((w, h), Image.Resampling.BILINEAR)
    return np.asarray(img, dtype=np.float32)


def make_picture(index: int, label: int, spec: CorpusSpec) -> np.ndarray:
    """A natural-image-like picture: gradient sky/ground, soft blobs, multi-scale texture, grain.

    Deterministic in ``(spec.seed, index)``. One in four pictures is portrait (375x500), like the
    mixed orientations of photo corpora. The class shifts the palette so labels mean something.
    """
    rng = np.random.default_rng([spec.seed, index])
    w, h = (spec.width, spec.height) if index % 4 else (spec.height, spec.width)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    hue = (label / max(spec.classes, 1)) * 2 * np.pi
    base_a = 110 + 90 * np.array([np.cos(hue), np.cos(hue + 2.1), np.cos(hue + 4.2)], dtype=np.float32)
    base_b = rng.uniform(20, 235, size=3).astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    t = (np.cos(angle) * xx / w + np.sin(angle) * yy / h)
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    img = base_a[None, None, :] * (1 - t[..., None]) + base_b[None, None, :] * t[..., None]
    for _ in range(int(rng.integers(3, 9))):
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        sx, sy = rng.uniform(15, 120), rng.uniform(15, 120)
        colour = rng.uniform(-120, 120, size=3).astype(np.float32)
        blob = np.exp(-(((xx - cx) / sx) ** 2 + ((yy - cy) / sy) ** 2) / 2)
        img += blob[..., None] * colour[None, None, :]
    texture = sum(_smooth_noise(rng, h, w, cell) * amp for cell, amp in ((64, 50.0), (16, 25.0), (4, 12.0), (2, 30.0)))
    img += (texture - texture.mean())[..., None]
    img += rng.normal(0, 10.0, size=img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def _write_one(args: tuple[int, int, str, CorpusSpec]) -> int:
    from PIL import Image

    index, label, path, spec = args
    Image.fromarray(make_picture(index, label, spec)).save(path, format="JPEG", quality=spec.quality)
    return os.path.getsize(path)


def jpeg_paths(root: Path, spec: CorpusSpec) -> tuple[list[Path], np.ndarray]:
    """Paths in storage order (class folder, then file name: the order ImageFolder sorts) and labels."""
    per_class = -(-spec.n // spec.classes)
    paths, labels = [], []
    for i in range(spec.n):
        c = i // per_class
        paths.append(root / f"class_{c:02d}" / f"img_{i:06d}.jpg")
        labels.append(c)
    return paths, np.asarray(labels, dtype=np.int64)


def _manifest_ok(path: Path, want: dict[str, Any]) -> bool:
    try:
        return json.loads(path.read_text()) == want
    except (OSError, ValueError):
        return False


def _write_manifest(path: Path, want: dict[str, Any]) -> None:
    path.write_text(json.dumps(want, indent=1, sort_keys=True))


def build_jpegs(root: Path, spec: CorpusSpec, workers: int) -> tuple[list[Path], np.ndarray]:
    """Generate the JPEG corpus (cached)."""
    paths, labels = jpeg_paths(root, spec)
    manifest = root / "manifest.json"
    want = asdict(spec)
    if _manifest_ok(manifest, want) and all(p.exists() for p in paths):
        return paths, labels
    shutil.rmtree(root, ignore_errors=True)
    for c in range(spec.classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    jobs = [(i, int(labels[i]), str(paths[i]), spec) for i in range(spec.n)]
    with mp.get_context("fork").Pool(workers) as pool:
        sizes = pool.map(_write_one, jobs, chunksize=16)
    logger.info("wrote %d JPEGs, %.1f MB (mean %.0f KB)", len(sizes), sum(sizes) / 1e6, np.mean(sizes) / 1e3)
    _write_manifest(manifest, want)
    return paths, labels


# ---------------------------------------------------------------------------------------------- records
def perfile_transform(path: str | os.PathLike[str], size: int = SIZE) -> np.ndarray:
    """What torchvision's ImageFolder + Resize(size) + CenterCrop(size) does, with Pillow only.

    Open, convert to RGB, scale the shorter side to ``size`` (bilinear, antialiased: Pillow's resize
    and torchvision's PIL path are the same call), then crop the centre ``size x size``.
    """
    from PIL import Image

    with open(path, "rb") as fh:
        img = Image.open(fh).convert("RGB")
    w, h = img.size
    if w <= h:
        new_w, new_h = size, int(size * h / w)
    else:
        new_w, new_h = int(size * w / h), size
    img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
    left = int(round((new_w - size) / 2.0))
    top = int(round((new_h - size) / 2.0))
    return np.asarray(img.crop((left, top, left + size, top + size)), dtype=np.uint8)


def _decode_one(path: str) -> np.ndarray:
    """shardkit's own transform (what ``shardkit convert`` stores), so the converter's output and
    every peer's records are byte-identical; falls back to :func:`perfile_transform`."""
    try:
        from shardkit.converters.images import ImageTransform
    except ImportError:
        return perfile_transform(path)
    return ImageTransform(SIZE, SIZE).load(Path(path)).array


def build_records(path: Path, jpegs: list[Path], spec: CorpusSpec, workers: int) -> np.ndarray:
    """Decode every JPEG once into ``records.npy`` ``[N, 224, 224, 3]`` uint8 (cached, memory-mapped)."""
    manifest = path.with_suffix(".json")
    want = {"corpus": asdict(spec), "size": SIZE, "version": 2}
    if _manifest_ok(manifest, want) and path.exists():
        return np.load(path, mmap_mode="r")
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(len(jpegs), *RECORD_SHAPE))
    with mp.get_context("fork").Pool(workers) as pool:
        for i, arr in enumerate(pool.imap(_decode_one, [str(p) for p in jpegs], chunksize=16)):
            out[i] = arr
    out.flush()
    del out
    _write_manifest(manifest, want)
    return np.load(path, mmap_mode="r")


# ---------------------------------------------------------------------------------------------- formats
def _fresh(dir_: Path, want: dict[str, Any]) -> bool:
    """True if ``dir_`` holds a finished build for ``want``; else empty it and return False."""
    if _manifest_ok(dir_ / "_built.json", want):
        return True
    shutil.rmtree(dir_, ignore_errors=True)
    return False


def write_shardkit(
    out: Path, records: np.ndarray, labels: np.ndarray, class_names: list[str], *, records_per_shard: int | None = None,
    src: Path | None = None, workers: int = 2,
) -> str:
    """The shardkit dataset: ``shardkit.convert`` from the JPEG folders when available, else
    ``DatasetWriter`` from the decoded records (same bytes). Returns how it was written."""
    from shardkit.formats import DatasetWriter, FieldSpec, open_dataset

    want = {"n": int(records.shape[0]), "shape": list(records.shape[1:]), "rps": records_per_shard,
            "src": str(src) if src else None, "labels_sum": int(labels.sum()), "version": 2}
    built = out.parent / (out.name + ".built.json")
    if _manifest_ok(built, want) and out.exists():
        return json.loads((out.parent / (out.name + ".how")).read_text())
    shutil.rmtree(out, ignore_errors=True)
    how = "DatasetWriter"
    convert = _converter()
    if src is not None and convert is not None:
        try:
            convert(str(src), str(out), kind="imagefolder", size=SIZE, workers=workers)
            how = "shardkit.convert"
        except Exception as exc:
            logger.warning("shardkit.convert failed (%s: %s); writing with DatasetWriter", type(exc).__name__, exc)
            shutil.rmtree(out, ignore_errors=True)
    if how == "shardkit.convert":
        with open_dataset(out) as ds:
            same = ds.num_records == records.shape[0] and np.array_equal(ds.fields["label"], labels)
            probe = np.unique(np.linspace(0, records.shape[0] - 1, 16).astype(np.int64))
            same = same and np.array_equal(ds.payload.read(probe), records[probe])
        if not same:
            logger.warning("shardkit.convert output differs from the decoded records; using DatasetWriter")
            shutil.rmtree(out, ignore_errors=True)
            how = "DatasetWriter"
    if how == "DatasetWriter":
        with DatasetWriter(out, kind="imagefolder", payload="image",
                           record=_fieldspec(FieldSpec, records.shape[1:]),
                           fields={"label": FieldSpec((), "int64")}, labels={"label": class_names},
                           records_per_shard=records_per_shard) as w:
            for b in range(0, records.shape[0], 256):
                w.write({"image": np.ascontiguousarray(records[b : b + 256]), "label": labels[b : b + 256]})
    (out.parent / (out.name + ".how")).write_text(json.dumps(how))
    _write_manifest(built, want)
    return how


def _fieldspec(cls: Any, shape: tuple[int, ...]) -> Any:
    return cls(tuple(int(s) for s in shape), "uint8")


def _converter() -> Callable[..., Any] | None:
    try:
        import shardkit

        return getattr(shardkit, "convert", None) or getattr(
            __import__("shardkit.converters", fromlist=["convert"]), "convert", None
        )
    except Exception:
        return None


def write_wds(out: Path, records: np.ndarray, labels: np.ndarray, records_per_shard: int) -> list[str]:
    """WebDataset tar shards via ``webdataset.ShardWriter``: ``__key__`` (storage position), raw
    uint8 bytes under ``.u8`` and the label under ``.cls``."""
    import webdataset as wds

    want = {"n": int(records.shape[0]), "shape": list(records.shape[1:]), "rps": records_per_shard, "version": 1}
    if not _fresh(out, want):
        out.mkdir(parents=True)
        with wds.ShardWriter(str(out / "shard-%05d.tar"), maxcount=records_per_shard, maxsize=1 << 40,
                             verbose=0) as sink:
            for i in range(records.shape[0]):
                sink.write({"__key__": f"{i:08d}", "u8": np.ascontiguousarray(records[i]).tobytes(),
                            "cls": int(labels[i])})
        _write_manifest(out / "_built.json", want)
    return sorted(str(p) for p in out.glob("shard-*.tar"))


def write_mds(out: Path, records: np.ndarray, labels: np.ndarray, records_per_shard: int) -> None:
    """MosaicML MDS shards via ``streaming.MDSWriter``: raw uint8 bytes, label and key columns."""
    from streaming import MDSWriter

    want = {"n": int(records.shape[0]), "shape": list(records.shape[1:]), "rps": records_per_shard, "version": 1}
    if _fresh(out, want):
        return
    # MDS cuts a shard when the next sample would pass size_limit; per-sample overhead is small.
    per_sample = int(np.prod(records.shape[1:])) + 40
    with MDSWriter(out=str(out), columns={"image": "bytes", "label": "int", "key": "int"},
                   size_limit=records_per_shard * per_sample, progress_bar=False) as w:
        for i in range(records.shape[0]):
            w.write({"image": np.ascontiguousarray(records[i]).tobytes(), "label": int(labels[i]), "key": i})
    _write_manifest(out / "_built.json", want)


def format_files(root: Path) -> list[Path]:
    """Every regular file under ``root`` (the set whose page cache is dropped before a run)."""
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file())


def resident_bytes(paths: list[Path]) -> int:
    """Bytes of ``paths`` now in the page cache (``mincore``): after a drop, what a run paged in.

    A cross-check of the process tree's ``read_bytes`` that counts the dataset files only (readahead
    included), so reads of Python libraries on a shared machine cannot inflate it.
    """
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    page = mmap.PAGESIZE
    total = 0
    for p in paths:
        size = p.stat().st_size
        if size == 0:
            continue
        with open(p, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            buf = (ctypes.c_char * size).from_buffer(mm)
            pages = -(-size // page)
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.addressof(buf), size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore failed on {p}")
            resident = int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))
            total += min(resident * page, size)
            del buf
        finally:
            mm.close()
    return total

