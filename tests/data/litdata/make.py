"""Make the LitData test datasets with litdata's own ``optimize``, and what its own reader reads back.

Re-run (needs litdata and torch, installed in /work/benchvenv, not in shardkit's environment):

    /work/benchvenv/bin/python tests/data/litdata/make.py

Writes, next to this file: ``plain/`` (JPEG and raw PIL images, numpy arrays and torch tensors with and
without a header, int/float/bool/str leaves; 24 samples in chunks of 8), ``zstd/`` (chunks compressed
with zstd), ``pickle/`` (a leaf only the pickle serializer takes) and ``media/`` (``audio:wav`` leaves
from waveforms, a ``jpeg_array`` leaf of three JPEGs), each with ``expected.npz``: the samples as
litdata's StreamingDataset decodes them, which the tests compare against (``media/``: the waveforms
as LitData's WAV encoding stores them without torchcodec, int16 of the clipped samples times 32767, and
the JPEGs as Pillow decodes them; decoding them back needs torchcodec, not installed).
``make.py media`` remakes only the fixtures named.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

HERE = Path(__file__).resolve().parent
N = 24
_JPEGS = Path(tempfile.mkdtemp())


def picture(i: int, size: tuple[int, int] = (32, 32)) -> np.ndarray:
    """A smooth picture, different for every sample."""
    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([(x * 7 + i * 9) % 256, (y * 5 + i * 13) % 256, ((x + y) * 3 + i * 31) % 256], axis=-1).astype(np.uint8)


def jpeg(i: int, size: tuple[int, int] = (32, 32)) -> Image.Image:
    """A JPEG opened from a file (LitData stores such a file's bytes as they are)."""
    path = _JPEGS / f"{i}-{size[0]}x{size[1]}.jpg"
    Image.fromarray(picture(i, size)).save(path, quality=90)
    return Image.open(path)


def plain_sample(i: int) -> dict:
    return {"image": jpeg(i), "label": i % 3, "pil": Image.fromarray(picture(i + 100)),
            "arr": np.arange(6, dtype=np.float32).reshape(2, 3) + i / 4, "vec": np.arange(5, dtype=np.int16) - i,
            "t": torch.arange(6, dtype=torch.int16).reshape(2, 3) * i, "tv": torch.arange(3, dtype=torch.float64) + i,
            "name": f"sample {i}", "cls": ["cat", "dog", "bird"][i % 3], "score": i / 2, "flag": bool(i % 2)}


def zstd_sample(i: int) -> dict:
    return {"image": jpeg(i, (24, 40)), "target": i % 5}


class Opaque:
    """Only the pickle serializer takes it."""

    def __init__(self, i: int) -> None:
        self.i = i


def pickle_sample(i: int) -> dict:
    return {"obj": Opaque(i), "label": i}


def media_sample(i: int) -> dict:
    from litdata.types import Audio, JpegArray

    return {"audio": Audio(array=waveform(i), sampling_rate=16000), "views": JpegArray([jpeg(3 * i + j, (16, 24)) for j in range(3)]),
            "label": i % 2}


def waveform(i: int) -> np.ndarray:
    """Half a second at 16 kHz (4000 samples for sample 3, to be padded or windowed), different for every sample."""
    n = 4000 if i == 3 else 8000
    return (0.5 * np.sin(2 * np.pi * (220 + 40 * i) * np.arange(n) / 16000)).astype(np.float32)


def media() -> None:
    import io

    from litdata import optimize

    out = HERE / "media"
    shutil.rmtree(out, ignore_errors=True)
    optimize(fn=media_sample, inputs=list(range(8)), output_dir=str(out), chunk_size=4, num_workers=1, mode="overwrite")
    from litdata.streaming.serializers import JPEGArraySerializer

    views = []
    for i in range(8):
        # What LitData's serializer stores for the sample's JpegArray (it re-encodes under its quality cap).
        data, _ = JPEGArraySerializer().serialize(media_sample(i)["views"])
        n = int(np.frombuffer(data[:4], np.uint32)[0])
        ends = np.cumsum(np.frombuffer(data[4 : 4 + 4 * n], np.uint32)) + 4 + 4 * n
        starts = [4 + 4 * n, *ends[:-1]]
        views.append(np.stack([np.asarray(Image.open(io.BytesIO(data[a:b])).convert("RGB")) for a, b in zip(starts, ends)]))
    audio = [(np.clip(waveform(i), -1, 1) * 32767.0).astype(np.int16) for i in range(8)]
    np.savez_compressed(out / "expected.npz", views=np.stack(views), label=np.arange(8) % 2,
                        audio=np.stack([np.pad(a, (0, 8000 - len(a))) for a in audio]),
                        frames=np.array([len(a) for a in audio]))


def read_back(out: Path) -> list[dict]:
    from litdata import StreamingDataset

    ds = StreamingDataset(f"local:{out}", shuffle=False)
    return [ds[i] for i in range(len(ds))]


def image_array(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):  # JPEG leaves come back as CHW uint8 tensors
        return value.permute(1, 2, 0).numpy()
    return np.asarray(value.convert("RGB"))


def main() -> None:
    from litdata import optimize

    for name, fn, kwargs in (("plain", plain_sample, {}), ("zstd", zstd_sample, {"compression": "zstd"}),
                             ("pickle", pickle_sample, {})):
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        optimize(fn=fn, inputs=list(range(N if name != "pickle" else 4)), output_dir=str(out), chunk_size=8,
                 num_workers=1, mode="overwrite", **kwargs)
        if name == "pickle":
            continue
        samples = read_back(out)
        arrays = {"image": np.stack([image_array(s["image"]) for s in samples])}
        if name == "plain":
            arrays.update(pil=np.stack([image_array(s["pil"]) for s in samples]),
                          label=np.array([s["label"] for s in samples]), arr=np.stack([s["arr"] for s in samples]),
                          vec=np.stack([s["vec"] for s in samples]), t=np.stack([s["t"].numpy() for s in samples]),
                          tv=np.stack([s["tv"].numpy() for s in samples]), cls=np.array([s["cls"] for s in samples]))
        else:
            arrays["label"] = np.array([s["target"] for s in samples])
        np.savez_compressed(out / "expected.npz", **arrays)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["media"]:
        media()
    else:
        main()
        media()
