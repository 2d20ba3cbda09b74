"""Write the committed golden datasets of the current format, 1.1 (run once; the outputs are committed).

``python tests/formats/golden/make_golden.py`` recreates ``v1.1-plain`` and ``v1.1-zstd`` next to this
file. The test suite never re-runs this: it decodes the committed bytes, so any change that would make
shardkit unable to read an existing dataset fails the tests.

``v1.0-plain`` and ``v1.0-zstd`` were written by format 1.0 (shardkit before checksummed fields) with
the same records, labels and boxes, but in one chunk per field. They are frozen: nothing regenerates
them, and ``test_golden.py`` pins the crc32c of each of their files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from shardkit.formats import DatasetWriter, FieldSpec

HERE = Path(__file__).parent
N = 7


def golden_records() -> np.ndarray:
    """Record i is a 4x3x3 uint8 image whose bytes are (i * 36 + j) % 251: easy to recompute."""
    return ((np.arange(N * 36).reshape(N, 4, 3, 3)) % 251).astype(np.uint8)


def golden_labels() -> np.ndarray:
    return np.array([2, 0, 1, 1, 0, 2, 2], dtype=np.int64)


def golden_boxes() -> np.ndarray:
    return (np.arange(N * 2 * 4, dtype=np.float32).reshape(N, 2, 4) / 4).astype(np.float32)


def main() -> None:
    for name, codec in (("v1.1-plain", None), ("v1.1-zstd", "zstd")):
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        with DatasetWriter(
            out,
            kind="golden",
            payload="image",
            record=FieldSpec((4, 3, 3), "uint8"),
            fields={"label": FieldSpec((), "int64"), "boxes": FieldSpec((2, 4), "float32")},
            labels={"label": ["cat", "dog", "owl"]},
            records_per_shard=3,
            field_chunk=4,  # two chunks per field, the second one padded
            compression=codec,
            transform={"size": [4, 3]},
            source={"note": "golden file of format 1.1"},
        ) as w:
            w.write({"image": golden_records(), "label": golden_labels(), "boxes": golden_boxes()})


if __name__ == "__main__":
    main()
