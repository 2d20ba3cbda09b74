"""The corruption matrix of issue 10: every kind of file x every kind of damage, through the CLI.

For a format 1.1 dataset (uncompressed and zstd) with a payload of three shards and two fields of two
chunks each, every file (root ``zarr.json``, payload ``zarr.json``, each payload shard, each field's
``zarr.json``, each field chunk) is damaged in one of six ways:

* ``flip-first`` / ``flip-middle`` / ``flip-last``: one byte XOR 0xFF at the start, middle or end;
* ``truncate``: cut to half its size;
* ``delete``;
* ``rewrite``: a deliberate, consistent edit that recomputes every checksum stored *inside* the file
  (the shard index's crc32c, a zstd frame's checksum, the root document's ``attributes_crc32c``), or
  for a JSON document a different but valid document. For the root document the edit is one that
  matters (one record fewer); a root document rewritten consistently in every respect (say, a renamed
  class) cannot be detected by any checksum it holds itself: it is the trust anchor.

Then ``shardkit verify``, ``shardkit info`` and ``shardkit sample`` run in-process through the
console entry point (``shardkit.cli.main.main``, the same code path as the installed command).

* ``verify`` must exit 1 and name the damaged file, in every case.
* ``info`` reads only metadata: the root document and the array documents (format 1.1 checks their
  recorded checksums when the dataset is opened). Damage to a payload shard or a field chunk is
  therefore legitimately invisible to it; ``verify`` is required to catch those cases.
* ``sample`` reads every shard index and loads the fields, so it must fail on everything except a
  flipped byte inside the *records* of an uncompressed shard before their last ``TAIL_SAMPLE_NBYTES``
  (the shard identity check reads those with the index): record bytes are not checksummed on the hot
  read path (that is ``verify``'s job). With zstd, the frame checksums catch even that.
* Whenever a command fails, stderr has exactly one ``error: `` line naming the file, and never
  ``internal error`` or a traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from shardkit.formats import DatasetWriter, FieldSpec
from shardkit.formats.codecs import get_codec
from shardkit.formats.spec import TAIL_SAMPLE_NBYTES
from tests.helpers.cli import run_main
from tests.helpers.datasets import edit_attributes, flip_byte, make_records, rewrite_shard_index

N, PER_SHARD, FIELD_CHUNK = 25, 10, 16
REC_NBYTES = 4 * 3 * 3
MUTATIONS = ["flip-first", "flip-middle", "flip-last", "truncate", "delete", "rewrite"]
FILES = [
    "zarr.json",
    "image/zarr.json", "image/c/0/0/0/0", "image/c/1/0/0/0", "image/c/2/0/0/0",
    "label/zarr.json", "label/c/0", "label/c/1",
    "boxes/zarr.json", "boxes/c/0/0/0", "boxes/c/1/0/0",
]


def _build(path: Path, compression: str | None) -> Path:
    with DatasetWriter(path, kind="test", payload="image", record=FieldSpec((4, 3, 3), "uint8"),
                       records_per_shard=PER_SHARD, field_chunk=FIELD_CHUNK, compression=compression,
                       fields={"label": FieldSpec((), "int64"), "boxes": FieldSpec((2, 4), "float32")}) as w:
        w.write({"image": make_records(N), "label": np.arange(N) % 5,
                 "boxes": np.arange(N * 8, dtype=np.float32).reshape(N, 2, 4)})
    return path


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("matrix")
    refs = {name: _build(base / name, codec) for name, codec in (("plain", None), ("zstd", "zstd"))}
    for ref in refs.values():  # the matrix covers every file of the dataset, no more, no less
        assert sorted(str(f.relative_to(ref)) for f in ref.rglob("*") if f.is_file()) == sorted(FILES)
    return refs


def _kind(rel: str) -> str:
    if rel == "zarr.json":
        return "root"
    if rel.endswith("zarr.json"):
        return "document"
    return "shard" if rel.startswith("image/") else "chunk"


def _rewrite(dataset: Path, rel: str) -> None:
    """A consistent edit of ``rel`` with every checksum inside the file recomputed (see module doc)."""
    file = dataset / rel
    kind = _kind(rel)
    if kind == "root":
        def one_record_fewer(a: dict) -> None:
            a["num_records"] -= 1
            a["shards"][-1]["stop"] -= 1
        edit_attributes(dataset, one_record_fewer)
    elif kind == "document":
        doc = json.loads(file.read_text())
        doc["fill_value"] = 1
        file.write_text(json.dumps(doc, indent=2))
    elif kind == "shard":
        rewrite_shard_index(file, PER_SHARD, lambda t: t.__setitem__([0, 1], t[[1, 0]]))
    else:
        codec = get_codec("zstd")
        assert codec is not None
        dtype = "<i8" if rel.startswith("label") else "<f4"
        values = np.empty(FIELD_CHUNK * (1 if dtype == "<i8" else 8), dtype=dtype)
        codec.decode(file.read_bytes(), values)
        values[0] += 1
        file.write_bytes(codec.encode(values))  # a valid zstd frame, content checksum included


def _damage(dataset: Path, rel: str, mutation: str) -> int | None:
    """Apply ``mutation``; returns the flipped position for flips."""
    file = dataset / rel
    size = file.stat().st_size
    if mutation == "delete":
        file.unlink()
    elif mutation == "truncate":
        file.write_bytes(file.read_bytes()[: size // 2])
    elif mutation == "rewrite":
        _rewrite(dataset, rel)
    else:
        pos = {"flip-first": 0, "flip-middle": size // 2, "flip-last": size - 1}[mutation]
        flip_byte(file, pos)
        return pos
    return None


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = run_main(*args)
    out = capsys.readouterr()
    return code, out.out, out.err


def _names(output: str, dataset: Path, rel: str) -> bool:
    if rel == "zarr.json":  # the root document, not image/zarr.json
        return any(s in output for s in (f"{dataset}/zarr.json", "dataset's zarr.json", "no zarr.json"))
    return f"{dataset}/{rel}" in output


def _assert_named_one_line_error(code: int, err: str, dataset: Path, rel: str, cmd: str) -> None:
    assert code == 1, (cmd, err)
    assert "Traceback" not in err and "internal error" not in err, (cmd, err)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("\r")]  # drop tqdm redraws
    errors_ = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors_) == 1 and lines[-1] == errors_[0], (cmd, err)
    assert _names(errors_[0], dataset, rel), (cmd, errors_[0])


@pytest.mark.parametrize("mutation", MUTATIONS)
@pytest.mark.parametrize("rel", FILES)
@pytest.mark.parametrize("codec", ["plain", "zstd"])
def test_corruption_matrix(references: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                           codec: str, rel: str, mutation: str) -> None:
    dataset = tmp_path / "ds"
    shutil.copytree(references[codec], dataset)
    pos = _damage(dataset, rel, mutation)
    kind = _kind(rel)

    code, out, err = _run(capsys, "verify", str(dataset))
    assert code == 1, (out, err)
    assert "Traceback" not in err and "internal error" not in err, err
    assert _names(out + err, dataset, rel), err

    code, out, err = _run(capsys, "info", str(dataset))
    if kind in ("shard", "chunk"):
        assert code == 0, err  # info reads only metadata: verify (above) catches this case
    else:
        _assert_named_one_line_error(code, err, dataset, rel, "info")

    code, out, err = _run(capsys, "sample", str(dataset), "--batch-size", "4")
    shard = int(rel.split("/")[2]) if kind == "shard" else -1
    data_nbytes = min(PER_SHARD, N - shard * PER_SHARD) * REC_NBYTES
    in_records = pos is not None and pos < data_nbytes
    in_tail = pos is not None and data_nbytes - min(TAIL_SAMPLE_NBYTES, data_nbytes) <= pos < data_nbytes
    if kind == "shard" and codec == "plain" and in_records and not in_tail:
        assert code == 0, err  # record bytes are verify's job, not the hot read path's
    else:
        _assert_named_one_line_error(code, err, dataset, rel, "sample")
