"""Reading and checking what a loader emitted: keys per epoch, labels, a storage-order map.

Rows are turned into storage positions once, and classified as ``permutation``, ``distinct`` or
``repeats`` (docs/design.md §15). ``.npy`` files are read without pickles, sizes bounded first.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np

from shardkit.errors import ConfigError, InputFileError

__all__ = ["OrderKeys", "Kind", "npy_shape", "load_npy", "prepare", "MAX_ELEMENTS"]

Kind = Literal["permutation", "distinct", "repeats"]
#: Largest array the tool reads (elements): 2**30 keys is 8 GiB of int64, several times that in use.
MAX_ELEMENTS = 1 << 30

ArrayOrPath = np.ndarray | str | os.PathLike[str]


@dataclass(frozen=True, eq=False)
class OrderKeys:
    """Validated orders: ``storage`` ``[epochs, k]`` int64 holds each epoch's keys as storage positions in
    emitted order; ``n`` records; ``kind`` (docs/design.md §15); ``labels`` ``[n]`` class codes by storage
    position or None; ``source`` for messages; ``notes`` on what was inferred or dropped."""

    storage: np.ndarray
    n: int
    kind: Kind
    labels: np.ndarray | None = None
    source: str = "keys"
    notes: tuple[str, ...] = field(default=())

    @property
    def epochs(self) -> int:
        return int(self.storage.shape[0])

    @property
    def length(self) -> int:
        """Keys per row (k)."""
        return int(self.storage.shape[1])


_KIND_NAMES = {"iu": "integers", "biuUS": "integer, boolean or string labels"}


def _header(fh: BinaryIO, name: str) -> tuple[tuple[int, ...], bool, np.dtype[np.generic]]:
    fmt = np.lib.format
    readers = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}
    try:
        version = fmt.read_magic(fh)
        if version not in readers:
            raise InputFileError(name, f"unsupported .npy format version {version}")
        shape, fortran, dtype = readers[version](fh)
    except InputFileError:
        raise
    except (ValueError, OSError, EOFError) as exc:
        raise InputFileError(name, f"not a .npy file ({exc})") from None
    return tuple(int(s) for s in shape), bool(fortran), np.dtype(dtype)


def _regular_file(path: str | os.PathLike[str]) -> Path:
    """``path``, refused unless it is a regular file (a fifo or device would hang or never end)."""
    p = Path(path)
    if not p.is_file():
        raise InputFileError(str(path), "no such file" if not p.exists() else "not a regular file")
    return p


def npy_shape(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """The shape a ``.npy`` file's header states (nothing else is read), for choosing what to run."""
    with open(_regular_file(path), "rb") as fh:
        return _header(fh, str(path))[0]


def load_npy(path: str | os.PathLike[str], *, kinds: str = "iu") -> np.ndarray:
    """Read a ``.npy`` array of dtype kind in ``kinds`` (``"iu"``: integers) safely: the header is
    checked first (dtype, element count, file size), then exactly that many elements are read from the
    same open file, so nothing is unpickled and nothing beyond :data:`MAX_ELEMENTS` is allocated."""
    name = str(path)
    with open(_regular_file(path), "rb") as fh:
        shape, fortran, dtype = _header(fh, name)
        if dtype.hasobject:
            raise InputFileError(name, "holds Python objects (a pickle); only plain numeric arrays are read")
        if dtype.kind not in kinds:
            raise InputFileError(name, f"expected {_KIND_NAMES.get(kinds, kinds)}, found dtype {dtype}")
        count = math.prod(shape)
        if count > MAX_ELEMENTS:
            raise InputFileError(name, f"{count} elements is more than this tool reads ({MAX_ELEMENTS})")
        if os.fstat(fh.fileno()).st_size - fh.tell() < count * dtype.itemsize:
            raise InputFileError(name, f"truncated: the header promises shape {shape} of {dtype}")
        flat = np.fromfile(fh, dtype=dtype, count=count)
    if flat.size != count:
        raise InputFileError(name, f"truncated: the header promises shape {shape} of {dtype}")
    return flat.reshape(shape, order="F" if fortran else "C")


def _as_array(value: ArrayOrPath, what: str, kinds: str) -> tuple[np.ndarray, str]:
    if isinstance(value, (str, os.PathLike)):
        return load_npy(value, kinds=kinds), str(value)
    arr = np.asarray(value)
    if arr.dtype.hasobject or arr.dtype.kind not in kinds:
        raise ConfigError(f"{what}: expected an array of {_KIND_NAMES.get(kinds, kinds)}, found dtype {arr.dtype}")
    return arr, what


def _drop_padding(arr: np.ndarray, name: str, notes: list[str]) -> np.ndarray:
    """Rows cut short are padded with -1 (``shardkit sample --limit``): drop or trim them."""
    neg = arr < 0
    if not neg.any():
        return arr
    if (arr[neg] != -1).any():
        raise InputFileError(name, f"negative key {int(arr[neg & (arr != -1)][0])}: keys are 0..N-1")
    valid = arr.shape[1] - neg.sum(axis=1)
    if not ((np.arange(arr.shape[1])[None, :] >= valid[:, None]) == neg).all():
        raise InputFileError(name, "-1 inside a row: only the tail of a row cut short may be -1 padding")
    full = valid == arr.shape[1]
    if full.any():
        notes.append(f"dropped {int((~full).sum())} row(s) cut short (-1 padding, e.g. shardkit sample --limit)")
        return np.asarray(arr[full])
    shortest = int(valid.min())
    if shortest < 2:
        raise InputFileError(name, "every row is cut short (-1 padding) and one holds fewer than 2 keys")
    notes.append(f"every row is cut short (-1 padding): using the first {shortest} keys of each")
    return arr[:, :shortest]


def _universe(sizes: dict[str, int | None], max_key: int, name: str, notes: list[str]) -> tuple[int, bool]:
    given = {k: int(v) for k, v in sizes.items() if v is not None}
    if len(set(given.values())) > 1:
        raise ConfigError("the number of records disagrees: " + ", ".join(f"{k} {v}" for k, v in given.items()))
    if given:
        n = next(iter(given.values()))
        if max_key >= n:
            src = next(iter(given))
            raise InputFileError(name, f"key {max_key} is outside 0..{n - 1} (the {src} give {n} records)")
        return n, True
    return max_key + 1, False


def _classify(arr: np.ndarray, n: int) -> Kind:
    s = np.sort(arr, axis=1)
    if (s[:, 1:] == s[:, :-1]).any():
        return "repeats"
    return "permutation" if arr.shape[1] == n else "distinct"


def _storage_map(arr: np.ndarray, name: str, n: int) -> np.ndarray:
    arr = arr.astype(np.int64, copy=False)
    if not np.array_equal(np.sort(arr), np.arange(n)):
        raise InputFileError(name, f"not a permutation of 0..{n - 1} (a storage position for every key, once)")
    return arr


def _label_codes(arr: np.ndarray, name: str, n: int, storage_of_key: np.ndarray) -> np.ndarray:
    _, codes = np.unique(arr, return_inverse=True)
    by_storage = np.empty(n, dtype=np.int64)
    by_storage[storage_of_key] = codes.reshape(-1)
    return by_storage


def _optional(value: ArrayOrPath | None, what: str, kinds: str, desc: str) -> tuple[np.ndarray | None, str, int | None]:
    """An optional per-key array (labels, storage map): 1-D, its length is a statement of N."""
    if value is None:
        return None, what, None
    arr, name = _as_array(value, what, kinds)
    if arr.ndim != 1:
        raise InputFileError(name, f"expected {desc}: a 1-D array with one entry per key, found shape {arr.shape}")
    return arr, name, int(arr.shape[0])


def prepare(
    keys: ArrayOrPath,
    *,
    labels: ArrayOrPath | None = None,
    storage_order: ArrayOrPath | None = None,
    records: int | None = None,
) -> OrderKeys:
    """Validate ``keys`` (``[epochs, k]`` integers, or a ``.npy`` file of them) into :class:`OrderKeys`.

    The number of records N comes from ``records``, the labels' length or the storage map's length
    (they must agree), else from the largest key + 1 (noted when the rows are not permutations).
    """
    arr, name = _as_array(keys, "keys", "iu")
    if arr.ndim != 2:
        raise InputFileError(name, f"expected a 2-D array [epochs, keys per epoch] (one row per epoch), "
                                   f"found shape {arr.shape}")
    if arr.shape[0] < 1 or arr.shape[1] < 2:
        raise InputFileError(name, f"expected at least one epoch of at least 2 keys, found shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) >= 1 << 63:
        raise InputFileError(name, f"key {int(arr.max())} does not fit in int64")
    arr = arr.astype(np.int64)
    notes: list[str] = []
    arr = _drop_padding(arr, name, notes)
    label_arr, label_name, n_labels = _optional(labels, "labels", "biuUS", "labels")
    map_arr, map_name, n_map = _optional(storage_order, "storage_order", "iu", "a key -> storage position map")
    n, stated = _universe({"records": records, "labels": n_labels, "storage order": n_map},
                          int(arr.max()), name, notes)
    kind = _classify(arr, n)
    if not stated and kind != "permutation":
        notes.append(f"N = {n} taken from the largest key + 1; give the number of records if the dataset is larger")
    storage_of_key = _storage_map(map_arr, map_name, n) if map_arr is not None else np.arange(n, dtype=np.int64)
    storage = storage_of_key[arr] if map_arr is not None else arr
    codes = _label_codes(label_arr, label_name, n, storage_of_key) if label_arr is not None else None
    return OrderKeys(storage=storage, n=n, kind=kind, labels=codes, source=name, notes=tuple(notes))
