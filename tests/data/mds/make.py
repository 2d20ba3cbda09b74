"""Make the MDS test datasets with mosaicml-streaming's own MDSWriter, and what its own reader reads back.

Re-run (needs mosaicml-streaming, installed in /work/benchvenv, not in shardkit's environment):

    /work/benchvenv/bin/python tests/data/mds/make.py

Writes, next to this file: ``plain/`` (every column encoding, 24 samples in 3 shards), ``zstd/`` and
``gz/`` (the same images compressed), ``pickle/`` (a ``pkl`` column), ``lists/`` (image lists:
``list[jpeg]``, ``list[png]``, ``list[pil]``, ``jpeg_array`` of three images per sample, and a
``list[png]`` whose length varies), each with ``expected.npz``: the samples as Streaming's reader
decodes them (images through PIL), which the tests compare against. ``make.py lists`` remakes only
the fixtures named.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
from PIL import Image
from streaming.base.format import reader_from_json

HERE = Path(__file__).resolve().parent
N = 24


def picture(i: int, size: tuple[int, int] = (32, 32)) -> np.ndarray:
    """A smooth picture (small as JPEG and in expected.npz), different for every sample."""
    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([(x * 7 + i * 9) % 256, (y * 5 + i * 13) % 256, ((x + y) * 3 + i * 31) % 256], axis=-1).astype(np.uint8)


def read_back(out: Path) -> list[dict]:
    """Every sample, in order, as Streaming's MDSReader decodes it."""
    index = json.loads((out / "index.json").read_text())
    samples = []
    for info in index["shards"]:
        reader = reader_from_json(str(out), None, info)
        if info.get("compression"):
            # Streaming decompresses into the raw file before reading.
            from streaming.base.compression import decompress
            data = (out / info["zip_data"]["basename"]).read_bytes()
            (out / info["raw_data"]["basename"]).write_bytes(decompress(info["compression"], data))
        for j in range(info["samples"]):
            samples.append(reader.decode_sample(reader.get_sample_data(j)))
        if info.get("compression"):
            (out / info["raw_data"]["basename"]).unlink()
    return samples


def plain() -> None:
    from streaming import MDSWriter

    out = HERE / "plain"
    shutil.rmtree(out, ignore_errors=True)
    cols = {"image": "jpeg", "label": "int", "png": "png", "pil": "pil", "arr": "ndarray:float32:2,3",
            "dyn": "ndarray", "dt": "ndarray:int16", "name": "str", "cls": "str", "si": "str_int", "u8": "uint8",
            "i16": "int16", "f": "float64", "meta": "json", "raw": "bytes"}
    with MDSWriter(out=str(out), columns=cols, size_limit=1 << 16) as w:
        for i in range(N):
            img = Image.fromarray(picture(i))
            w.write({"image": img, "label": i % 3, "png": img, "pil": img,
                     "arr": (np.arange(6, dtype=np.float32).reshape(2, 3) + i / 4),
                     "dyn": (np.arange(4, dtype=np.int32).reshape(2, 2) * i), "dt": np.arange(5, dtype=np.int16) - i,
                     "name": f"sample {i}", "cls": ["cat", "dog", "bird"][i % 3], "si": 100 + i, "u8": i,
                     "i16": -i, "f": i / 2, "meta": {"i": i}, "raw": bytes([i]) * (i + 1)})
    samples = read_back(out)
    np.savez_compressed(out / "expected.npz",
                        image=np.stack([np.asarray(s["image"].convert("RGB")) for s in samples]),
                        png=np.stack([np.asarray(s["png"].convert("RGB")) for s in samples]),
                        pil=np.stack([np.asarray(s["pil"].convert("RGB")) for s in samples]),
                        label=np.array([s["label"] for s in samples]), arr=np.stack([s["arr"] for s in samples]),
                        dyn=np.stack([s["dyn"] for s in samples]), dt=np.stack([s["dt"] for s in samples]),
                        cls=np.array([s["cls"] for s in samples]), si=np.array([s["si"] for s in samples]))


def compressed(algo: str) -> None:
    from streaming import MDSWriter

    out = HERE / algo
    shutil.rmtree(out, ignore_errors=True)
    with MDSWriter(out=str(out), columns={"image": "jpeg", "class": "uint16"}, compression=algo, size_limit=1 << 14) as w:
        for i in range(N):
            w.write({"image": Image.fromarray(picture(i, (24, 40))), "class": i % 5})
    samples = read_back(out)
    np.savez_compressed(out / "expected.npz", image=np.stack([np.asarray(s["image"].convert("RGB")) for s in samples]),
                        label=np.array([s["class"] for s in samples]))


def pickled() -> None:
    from streaming import MDSWriter

    out = HERE / "pickle"
    shutil.rmtree(out, ignore_errors=True)
    with MDSWriter(out=str(out), columns={"obj": "pkl", "label": "int"}) as w:
        for i in range(4):
            w.write({"obj": {"i": i}, "label": i})


def lists() -> None:
    from streaming import MDSWriter

    out = HERE / "lists"
    shutil.rmtree(out, ignore_errors=True)
    cols = {"views": "list[jpeg]", "masks": "list[png]", "raw": "list[pil]", "frames": "jpeg_array",
            "ragged": "list[png]", "label": "int"}
    n = 8
    with MDSWriter(out=str(out), columns=cols, size_limit=1 << 15) as w:
        for i in range(n):
            imgs = [Image.fromarray(picture(3 * i + j, (16, 24))) for j in range(3)]
            frames = []
            for img in imgs:
                buf = io.BytesIO()
                img.save(buf, format="JPEG", quality=90)
                frames.append(buf.getvalue())
            w.write({"views": imgs, "masks": imgs, "raw": imgs, "frames": frames, "ragged": imgs[: 1 + i % 3],
                     "label": i % 2})
    samples = read_back(out)

    def stacked(key: str) -> np.ndarray:
        return np.stack([np.stack([np.asarray(im.convert("RGB")) for im in s[key]]) for s in samples])

    np.savez_compressed(out / "expected.npz", views=stacked("views"), masks=stacked("masks"), raw=stacked("raw"),
                        frames=stacked("frames"), ragged_counts=np.array([len(s["ragged"]) for s in samples]),
                        label=np.array([s["label"] for s in samples]))


if __name__ == "__main__":
    import sys

    makers = {"plain": plain, "zstd": lambda: compressed("zstd"), "gz": lambda: compressed("gz"), "pickle": pickled,
              "lists": lists}
    for name in sys.argv[1:] or list(makers):
        makers[name]()
