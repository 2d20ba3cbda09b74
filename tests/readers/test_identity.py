"""A sampler notices when the dataset it reads is replaced under it (``convert --overwrite`` of the same
path during a run) and stops with an error naming the path, instead of pairing new payload with the
labels it loaded from the old dataset. An unchanged dataset never raises."""

from __future__ import annotations

import collections
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import MissingShardError, SamplerError
from shardkit.formats import DatasetWriter, FieldSpec
from shardkit.formats.dataset import DatasetDocuments
from shardkit.formats.metadata import MAX_DOCUMENT_NBYTES, read_dataset_meta
from shardkit.readers import TieredSampler
from shardkit.readers import identity as identity_module
from shardkit.readers.identity import DatasetIdentity
from tests.helpers.sampler_data import check_batch, collect, encode, make_dataset

N = 40
STACKS = {
    "ram": dict(tiers="ram", ram_size="4records"),
    "ram+ssd": dict(tiers="ram,ssd", ram_size="4records", ssd_size="6records"),
}


def _other_dataset(path: Path, n: int = N) -> Path:
    """Same record count and schema, other records: record k holds what record n-1-k held."""
    keys = np.arange(n, dtype=np.int64)
    with DatasetWriter(path, kind="test", payload="image", record=FieldSpec((4, 4, 1), "uint8"),
                       fields={"label": FieldSpec((), "int64"), "pair": FieldSpec((2,), "float32")},
                       records_per_shard=3) as w:  # fmt: skip
        w.write({"image": encode(keys[::-1]), "label": keys * 3, "pair": np.stack([keys, -keys], 1).astype(np.float32)})
    return path


def _overwrite(ds: Path, replacement: Path) -> None:
    """What ``convert --overwrite`` does to the path: delete the old dataset, write the new one."""
    shutil.rmtree(ds)
    shutil.copytree(replacement, ds)


def _error(ds: Path) -> str:
    return rf"{re.escape(str(ds))}: the dataset (was replaced|this sampler reads was removed)"


@pytest.mark.parametrize("stack", list(STACKS))
def test_replaced_between_epochs(tmp_path: Path, ssd_dir: Path, stack: str) -> None:
    ds = make_dataset(tmp_path / "ds", N)
    other = _other_dataset(tmp_path / "other")
    s = TieredSampler(ds, ssd_dir=ssd_dir, batch_size=4, **STACKS[stack])  # type: ignore[arg-type]
    assert sorted(np.concatenate(collect(s)).tolist()) == list(range(N))  # epoch 0, unchanged
    _overwrite(ds, other)
    with pytest.raises(SamplerError, match=_error(ds)):
        collect(s)  # epoch 1
    s.close()
    assert list(ssd_dir.iterdir()) == []


def _move_into_place(ds: Path, replacement: Path) -> None:
    """Replace the directory in one step (``mv``): every file changes at once."""
    os.rename(ds, ds.with_name(ds.name + ".old"))
    os.rename(replacement, ds)


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("how", ["overwrite", "move"])
def test_replaced_mid_run(tmp_path: Path, ssd_dir: Path, stack: str, how: str) -> None:
    """Replaced after the first batch of a three-epoch run: the run stops with an error naming the
    dataset before the next epoch starts, and every batch it delivered was whole and right
    (check_batch: payload, label and key of every row agree), none mixed from the two datasets.

    During ``convert --overwrite`` the old files disappear one by one; a read that finds a shard gone
    before the root document is gone stops the run with that file's own error (MissingShardError,
    which names the shard's path in the dataset) instead."""
    ds = make_dataset(tmp_path / "ds", N)
    other = _other_dataset(tmp_path / "other")
    s = TieredSampler(ds, ssd_dir=ssd_dir, batch_size=2, epochs=3, **STACKS[stack])  # type: ignore[arg-type]
    delivered = []
    with pytest.raises((SamplerError, MissingShardError)) as info:
        for i, batch in enumerate(s):
            delivered.append(check_batch(batch))
            if i == 0:
                (_overwrite if how == "overwrite" else _move_into_place)(ds, other)
    if how == "move" or isinstance(info.value, SamplerError):
        assert re.match(_error(ds), str(info.value)), info.value
    else:
        assert str(info.value).startswith(str(ds) + os.sep) and "missing" in str(info.value)
    assert 1 <= sum(k.size for k in delivered) < N  # stopped within the first epoch
    assert s.epoch == 0


def test_removed_dataset(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", N)
    s = TieredSampler(ds, batch_size=8)
    collect(s)
    shutil.rmtree(ds)
    with pytest.raises(SamplerError, match=rf"{re.escape(str(ds))}: .*removed or is being rewritten"):
        collect(s)


def test_unchanged_dataset_never_raises(tmp_path: Path, ssd_dir: Path) -> None:
    """Many epochs and iterations, other readers of the same dataset, files touched, and a re-conversion
    that writes byte-identical data (same identity: nothing the sampler reads changed)."""
    ds = make_dataset(tmp_path / "ds", N)
    identity = DatasetIdentity.of(ds)
    s = TieredSampler(ds, ssd_dir=ssd_dir, batch_size=3, epochs=2, **STACKS["ram+ssd"])  # type: ignore[arg-type]
    for _ in range(3):
        keys = np.concatenate(collect(s)).reshape(2, N)
        assert all(sorted(row) == list(range(N)) for row in keys.tolist())
        for f in ds.rglob("*"):
            os.utime(f)  # timestamps are not identity
        TieredSampler(ds, batch_size=5).close()  # another sampler of the same dataset
    shutil.rmtree(ds)
    make_dataset(ds, N)  # the same conversion again
    assert DatasetIdentity.of(ds) == identity
    assert sum(k.size for k in collect(s)) == 2 * N


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path | str]:
    """Every read of a root document by an identity check, recorded."""
    reads: list[Path | str] = []
    real = identity_module._fingerprint_and_tag

    def counted(path: Path | str, options: object = None) -> tuple[str, str | None]:
        reads.append(path)
        return real(path, options)  # type: ignore[arg-type]

    monkeypatch.setattr(identity_module, "_fingerprint_and_tag", counted)
    return reads


def test_unchanged_local_document_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampler checks every dataset of its mixture after every block: while the local root document's
    stat (entry, inode, size, mtime, ctime) stays as it was when its content matched, a check costs two
    stats instead of a path resolution, an open, a read and a SHA-256 (5 datasets: 1.5-1.9x the CPU per
    record of one). Files are trusted as settled here (no racy window)."""
    monkeypatch.setattr(identity_module, "RACY_NS", -(1 << 62))
    ds = make_dataset(tmp_path / "ds", N)
    reads = _count_reads(monkeypatch)
    identity = DatasetIdentity.of(ds)
    for _ in range(5):
        identity.check()
    assert reads == [ds]  # the open's read only
    for f in ds.rglob("*"):
        os.utime(f)  # a new mtime: read once more, then trusted again
    identity.check()
    identity.check()
    assert reads == [ds, ds]


def test_replaced_document_is_read_and_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A root document moved into place (another inode) after the stat was remembered is read and refused."""
    monkeypatch.setattr(identity_module, "RACY_NS", -(1 << 62))
    ds = make_dataset(tmp_path / "ds", N)
    other = _other_dataset(tmp_path / "other")
    identity = DatasetIdentity.of(ds)
    identity.check()
    os.replace(other / "zarr.json", ds / "zarr.json")
    with pytest.raises(SamplerError, match=_error(ds)):
        identity.check()


def test_same_size_rewrite_in_the_same_tick_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """File times are coarse: a same-size in-place rewrite in the clock tick of the last read keeps every
    stat value, so a document changed within the racy window is always read again. The tick is made
    coarse here: every file time reads as one instant (a minute ahead, as a server's clock may be)."""
    tick = time.time_ns() + 60_000_000_000
    real = identity_module._stat_key

    def coarse(root: Path) -> tuple[int, int, int, int, int] | None:
        key = real(root)
        return None if key is None else (*key[:3], tick, tick)

    monkeypatch.setattr(identity_module, "_stat_key", coarse)
    ds = make_dataset(tmp_path / "ds", N)
    identity = DatasetIdentity.of(ds)
    identity.check()
    doc = ds / "zarr.json"
    data = doc.read_bytes()
    at = data.index(b'"kind"')
    changed = data[:at] + data[at:].replace(b'"test"', b'"tset"', 1)
    assert len(changed) == len(data) and changed != data
    with open(doc, "r+b") as fh:  # in place: same inode, same size
        fh.write(changed)
    with pytest.raises(SamplerError, match=_error(ds)):
        identity.check()


def test_remembered_documents_are_bounded_by_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process keeps the documents of the remote datasets it opened within a byte budget, not only a
    count: two root documents of the largest size allowed push out every older one (a few small ones
    would otherwise stay, 32 of the largest would hold 2 GiB)."""
    monkeypatch.setattr(identity_module, "_OPENED", collections.OrderedDict())
    meta = read_dataset_meta(make_dataset(tmp_path / "ds", N))

    def remember(name: str, nbytes: int) -> None:
        url = f"s3://bucket/{name}"
        identity_module.remember(DatasetIdentity(url, name, "etag", nbytes=nbytes), DatasetDocuments(meta, {}), url)

    for name in ("a", "b", "c"):
        remember(name, 1 << 20)
    assert list(identity_module._OPENED) == ["s3://bucket/a", "s3://bucket/b", "s3://bucket/c"]
    remember("large", MAX_DOCUMENT_NBYTES)
    remember("larger", MAX_DOCUMENT_NBYTES)
    assert list(identity_module._OPENED) == ["s3://bucket/large", "s3://bucket/larger"]
    kept = sum(i.nbytes for i, _, _ in identity_module._OPENED.values())
    assert kept <= identity_module.MAX_REMEMBERED_NBYTES
    remember("huge", 3 * identity_module.MAX_REMEMBERED_NBYTES)  # over the budget alone: the latest is kept
    assert list(identity_module._OPENED) == ["s3://bucket/huge"]
