"""Generated corpora for the converter tests: small, seeded, with every bad-input case."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import soundfile as sf
from PIL import Image

IS_ROOT = os.geteuid() == 0


def natural_image(h: int, w: int, seed: int) -> np.ndarray:
    """Smooth gradients + a few shapes + noise: compresses and resizes like a photo."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.empty((h, w, 3))
    for c in range(3):
        a, b, p = rng.uniform(-1, 1, 3)
        img[:, :, c] = 128 + 60 * np.sin(a * x / 23 + b * y / 31 + p * 6)
    for _ in range(3):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(5, max(6, min(h, w) / 3))
        img[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def save_jpeg(path: Path, arr: np.ndarray, **kw) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path, "JPEG", quality=90, **kw)


def bomb_png(path: Path, width: int = 30000, height: int = 30000) -> None:
    """A tiny PNG whose header claims width x height pixels (Pillow refuses it at open)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def corrupt_png(path: Path) -> None:
    """A PNG Pillow recognises whose pixel data does not decompress."""
    buf = io.BytesIO()
    Image.fromarray(natural_image(40, 40, 9)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    start = data.index(b"IDAT") + 4
    for k in range(start + 2, min(start + 200, len(data) - 16)):
        data[k] ^= 0x5A
    path.write_bytes(bytes(data))


def add_bad_images(folder: Path) -> dict[str, str]:
    """Every bad-image case in ``folder``; returns {file name: expected reason category}."""
    folder.mkdir(parents=True, exist_ok=True)
    expected = {}
    corrupt_png(folder / "corrupt.png")
    expected["corrupt.png"] = "corrupt"
    buf = io.BytesIO()
    Image.fromarray(natural_image(120, 160, 3)).save(buf, "JPEG", quality=90)
    (folder / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    expected["truncated.jpg"] = "truncated"
    (folder / "zero.jpg").write_bytes(b"")
    expected["zero.jpg"] = "empty"
    (folder / "text.jpg").write_text("this is not an image\n")
    expected["text.jpg"] = "unsupported"
    (folder / "notes.txt").write_text("a stray file\n")
    expected["notes.txt"] = "unsupported"
    bomb_png(folder / "bomb.png")
    expected["bomb.png"] = "too-large"
    # Unreadable: chmod 000 does not stop root, a FIFO (never opened: it would block) and a
    # directory named like an image fail for everyone.
    os.mkfifo(folder / "fifo.jpg")
    expected["fifo.jpg"] = "unreadable"
    (folder / "dir.jpg").mkdir()
    expected["dir.jpg"] = "unreadable"
    if not IS_ROOT:
        save_jpeg(folder / "noperm.jpg", natural_image(30, 30, 4))
        os.chmod(folder / "noperm.jpg", 0)
        expected["noperm.jpg"] = "unreadable"
    os.symlink(folder / "does-not-exist.jpg", folder / "broken.jpg")
    expected["broken.jpg"] = "missing"
    return expected


def make_imagefolder(root: Path, per_class: int = 5, classes=("cat", "dog", "eel"), bad: bool = True,
                     splits=("train", "val")) -> dict[str, str]:
    expected = {}
    seed = 0
    for split in splits:
        for c in classes:
            if split == "val" and c == "eel":
                continue  # a split may lack a class: label ids must still agree
            for i in range(per_class):
                h, w = 48 + 7 * (seed % 5), 64 + 5 * (seed % 7)
                save_jpeg(root / split / c / f"{c}{i:03d}.jpg", natural_image(h, w, seed))
                seed += 1
    if bad:
        expected = add_bad_images(root / "train" / "dog")
    return expected


def write_wav(path: Path, x: np.ndarray, rate: int, subtype: str = "PCM_16") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), x, rate, subtype=subtype)


def tone(freq: float, rate: int, seconds: float, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(round(rate * seconds))) / rate
    return amp * np.sin(2 * np.pi * freq * t)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/shardkit-pwned",))


def write_pickle(path: Path, obj, protocol: int = 2) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        pickle.dump(obj, fh, protocol=protocol)


def make_cifar10(root: Path, per_batch: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d = root / "cifar-10-batches-py"
    write_pickle(d / "batches.meta", {b"label_names": [f"class{k}".encode() for k in range(10)], b"num_vis": 3072})
    out = {"data": [], "labels": []}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, per_batch).tolist()
        write_pickle(d / name, {b"batch_label": name.encode(), b"labels": labels, b"data": data,
                                b"filenames": [f"{name}_{k}.png".encode() for k in range(per_batch)]})
        if name != "test_batch":
            out["data"].append(data)
            out["labels"].append(labels)
    return {"data": np.concatenate(out["data"]), "labels": np.concatenate(out["labels"])}


def make_cifar100(root: Path, n: int = 8, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d = root / "cifar-100-python"
    write_pickle(d / "meta", {"fine_label_names": [f"fine{k}" for k in range(100)],
                              "coarse_label_names": [f"coarse{k}" for k in range(20)]}, protocol=4)
    res = {}
    for split in ("train", "test"):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        fine = rng.integers(0, 100, n).tolist()
        coarse = rng.integers(0, 20, n).tolist()
        write_pickle(d / split, {"data": data, "fine_labels": fine, "coarse_labels": coarse}, protocol=4)
        res[split] = {"data": data, "fine": np.array(fine), "coarse": np.array(coarse)}
    return res


def coco_doc(images, annotations, categories) -> dict:
    return {"info": {"description": "generated"}, "licenses": [], "images": images,
            "annotations": annotations, "categories": categories}


def write_json(path: Path, doc) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def interrupt_after(inputs: int) -> Callable[[int, int, int], None]:
    """A progress callback that raises KeyboardInterrupt (as Ctrl-C would) once ``inputs`` are done."""

    def progress(done: int, total: int, records: int) -> None:
        if done == inputs:
            raise KeyboardInterrupt

    return progress
