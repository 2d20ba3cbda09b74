"""Which records to look at: given keys, a seeded uniform sample, or the records of one class."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardkit.errors import ConfigError
from shardkit.formats import Dataset
from shardkit.order.seeds import Domain, check_seed, rng

__all__ = ["MAX_RECORDS", "Selection", "SELECTION_DEFAULTS", "parse_keys", "select_keys"]

#: Most records one sheet or export holds (a contact sheet of 256 frames of 224 x 224 is 38 MiB).
MAX_RECORDS = 256
_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


@dataclass(frozen=True)
class Selection:
    """How to choose records: ``keys`` in order; else the first ``limit`` records, or ``random`` ones
    drawn uniformly without replacement with ``seed`` (an integer in ``[0, 2**64)``), of class ``label``
    when given."""

    keys: Sequence[int] | None = None
    random: int | None = None
    seed: int = 0
    label: str | None = None
    limit: int = 16


#: The defaults of :func:`~shardkit.viz.show`, :func:`~shardkit.viz.export` and their CLI options.
SELECTION_DEFAULTS = Selection()


def parse_keys(text: str, *, what: str = "--keys") -> list[int]:
    """``"3,10-12,40"`` -> ``[3, 10, 11, 12, 40]``."""
    keys: list[int] = []
    for part in text.split(","):
        m = _RANGE.fullmatch(part)
        if m is None:
            raise ConfigError(f"{what}: expected keys such as 3,10-12,40, found {text!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo or hi - lo >= MAX_RECORDS or len(keys) + hi - lo + 1 > MAX_RECORDS:
            raise ConfigError(f"{what}: expected at most {MAX_RECORDS} keys in increasing ranges, found {text!r}")
        keys.extend(range(lo, hi + 1))
    return keys


def _label_id(ds: Dataset, name: str, what: str) -> int:
    names = ds.meta.labels.get("label") or []
    if name in names:
        return names.index(name)
    shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    raise ConfigError(f"{what}: no class {name!r} in {ds.path}; classes: {shown or 'none (no label names)'}")


def select_keys(ds: Dataset, sel: Selection, *, naming: str = "python") -> np.ndarray:
    """The keys ``sel`` picks in ``ds`` (at most :data:`MAX_RECORDS`), in the order to show them; a
    ``ConfigError`` names the option as the user wrote it (``--random`` or ``random``)."""
    def name(option: str) -> str:
        return f"--{option}" if naming == "cli" else option

    n = ds.num_records
    if sel.keys is not None:
        keys = np.asarray(list(sel.keys), dtype=np.int64).reshape(-1)
        bad = keys[(keys < 0) | (keys >= n)]
        if bad.size:
            raise ConfigError(f"{name('keys')}: record {int(bad[0])} is outside the dataset's keys 0..{n - 1}")
        if keys.size > MAX_RECORDS:
            raise ConfigError(f"{name('keys')}: at most {MAX_RECORDS} records, found {keys.size}")
        return keys
    pool = np.arange(n, dtype=np.int64)
    if sel.label is not None:
        if "label" not in ds.fields:
            raise ConfigError(f"{name('label')}: {ds.path} has no label field")
        pool = np.flatnonzero(ds.fields["label"] == _label_id(ds, sel.label, name("label"))).astype(np.int64)
    if sel.random is None:
        if not 1 <= sel.limit <= MAX_RECORDS:
            raise ConfigError(f"{name('limit')}: expected 1 to {MAX_RECORDS} records, found {sel.limit}")
        return pool[: sel.limit]
    if not 1 <= sel.random <= MAX_RECORDS:
        raise ConfigError(f"{name('random')}: expected 1 to {MAX_RECORDS} records, found {sel.random}")
    seed = check_seed(sel.seed, what=name("seed"))
    k = min(sel.random, pool.size)
    return np.sort(pool[rng(Domain.RECORD_SAMPLE, seed).choice(pool.size, size=k, replace=False)])
