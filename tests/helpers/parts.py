"""Helpers shared by the tests of conversions in parts, appends and merges."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shardkit.formats import open_dataset
from shardkit.formats.provenance import Provenance
from shardkit.formats.spec import SkippedInput
from shardkit.stores import Store

REPO = Path(__file__).resolve().parents[2]
DATASETS = REPO / "datasets"


def assert_same_records(a: Path | str, b: Path | str, *, roots: Sequence[Path] = ()) -> None:
    """``a`` and ``b`` (directories or URLs) hold the same records: every payload shard file byte for byte,
    every field, the label names and the skip list (paths under any of ``roots``, the corpora, compared
    relative to it)."""
    with open_dataset(a) as x, open_dataset(b) as y:
        assert x.num_records == y.num_records
        assert [(s.start, s.stop, s.nbytes, s.crc32c, s.data_crc32c, s.index_crc32c) for s in x.meta.shards] == \
               [(s.start, s.stop, s.nbytes, s.crc32c, s.data_crc32c, s.index_crc32c) for s in y.meta.shards]
        for i, (a_info, b_info) in enumerate(zip(x.meta.shards, y.meta.shards)):
            assert x.store.get(a_info.path) == y.store.get(b_info.path), f"shard {i}"
        assert x.meta.labels == y.meta.labels
        assert set(x.fields) == set(y.fields)
        for name in x.fields:
            np.testing.assert_array_equal(x.fields[name], y.fields[name], err_msg=name)
        assert x.meta.files == y.meta.files  # field chunks (provenance too) and array documents, byte for byte
        assert _skips(x.meta.skipped, roots) == _skips(y.meta.skipped, roots)
        # Where every record came from: the same inputs (named under their corpus), the same change counts.
        px, py = (Provenance.from_meta(d.meta, where=str(d.path)) for d in (x, y))
        assert (px is None) == (py is None)
        if px is not None and py is not None:
            assert px.columns == py.columns and dict(px.changes) == dict(py.changes)
            assert _inputs(px, x.store, roots) == _inputs(py, y.store, roots)


def _inputs(prov: Provenance, store: Store, roots: Sequence[Path]) -> list[str]:
    return [_under(os.path.join(prov.root, name), roots) for name in prov.names(store)]


def _under(path: str, roots: Sequence[Path]) -> str:
    for root in roots:
        if path.startswith(f"{root}/"):
            return path[len(str(root)) + 1 :]
    return path


def _skips(skipped: Sequence[SkippedInput], roots: Sequence[Path]) -> list[tuple[str, str]]:
    out = []
    for s in skipped:
        path, reason = s.path, s.reason
        for root in roots:
            if path.startswith(f"{root}/"):
                path, reason = path[len(str(root)) + 1 :], reason.replace(f"{root}/", "")
                break
        out.append((path, reason))
    return out


def tree_digest(path: Path) -> dict[str, str]:
    """Every file under ``path`` and its sha256 (what "nothing on disk changed" compares)."""
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def class_corpus(root: Path, classes: list[str], *, bad: dict[str, str] | None = None) -> Path:
    """A copy of the named classes of ``datasets/imagefolder/train``, plus bad files ``{class/name: text}``."""
    train = DATASETS / "imagefolder" / "train"
    for c in classes:
        shutil.copytree(train / c, root / c)
    for rel, text in (bad or {}).items():
        if (root / rel).parent.is_dir():
            (root / rel).write_text(text)
    return root
