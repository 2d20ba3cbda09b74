"""CIFAR-10 / CIFAR-100 python batches, read with a restricted unpickler.

Pickle can execute arbitrary code: a "batch" downloaded from anywhere could run a program when
loaded. :class:`SafeUnpickler` therefore resolves only the handful of globals that plain data needs
(numpy's array and dtype reconstruction, builtin container/scalar types and latin-1 byte
decoding); anything else is refused with a :class:`~shardkit.errors.ConversionError` naming the file
and the global it asked for, and object arrays are refused too. A refused batch stops the run even
without ``--strict``: silently dropping 10 000 records of an untrusted file is not a skip.

Layouts: CIFAR-10 ``data_batch_1..5`` (train), ``test_batch`` and ``batches.meta``; CIFAR-100
``train``, ``test`` and ``meta`` (fine and coarse labels). ``SRC`` may be the batch directory or its
parent holding ``cifar-10-batches-py`` / ``cifar-100-python``.

Records: ``image`` uint8 ``[H, W, 3]`` (native 32x32 unless ``--size`` is given), ``label`` int64,
and for CIFAR-100 ``coarse_label`` int64.
"""

from __future__ import annotations

import io
import pickle
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.converters.base import Converter, Record, ScanResult, register
from shardkit.converters.imagefolder import IMAGE_OPTIONS
from shardkit.converters.images import ImageTransform
from shardkit.errors import ConfigError, ConversionError
from shardkit.formats import FieldSpec

__all__ = ["SafeUnpickler", "safe_load", "Cifar10Converter", "Cifar100Converter"]

_NUMPY_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}
_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "bytes", "bytearray", "str", "int", "float", "bool", "complex"}


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # Python 3 pickles bytes at protocol <= 2 as _codecs.encode(str, "latin1").
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r} is not allowed")
    return text.encode("latin1")


class SafeUnpickler(pickle.Unpickler):
    """Unpickler that allows only plain containers, bytes and numpy arrays/dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NUMPY_GLOBALS:
            return super().find_class(module, name)
        if module in ("builtins", "__builtin__") and name in _BUILTINS:
            return super().find_class("builtins", name)
        if module == "_codecs" and name == "encode":
            return _latin1_encode
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def _check_plain(obj: Any, path: Path) -> None:
    if isinstance(obj, np.ndarray) and obj.dtype.hasobject:
        raise ConversionError(f"{path}: refused to load an object array (pickle can execute code)")
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_plain(k, path)
            _check_plain(v, path)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _check_plain(v, path)


def safe_load(path: Path) -> Any:
    """Unpickle ``path`` with :class:`SafeUnpickler` (``ConversionError`` naming the file on refusal)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConversionError(f"{path}: cannot read the CIFAR batch: {exc}") from None
    try:
        obj = SafeUnpickler(io.BytesIO(data), encoding="bytes").load()
    except pickle.UnpicklingError as exc:
        raise ConversionError(
            f"{path}: refused to unpickle: {exc}; only plain containers, bytes and numpy arrays are "
            "allowed, because pickle can execute code"
        ) from None
    except Exception as exc:
        raise ConversionError(f"{path}: not a readable CIFAR python batch ({type(exc).__name__}: {exc})") from None
    _check_plain(obj, path)
    return obj


def _key(d: dict[Any, Any], name: str, path: Path) -> Any:
    for k in (name, name.encode()):
        if k in d:
            return d[k]
    raise ConversionError(f"{path}: expected a dict with key {name!r}, found keys {sorted(map(str, d))[:8]}")


def _names(values: Any) -> list[str]:
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]


def _batch_dir(src: Path, marker: str, parent_name: str) -> Path | None:
    for cand in (src, src / parent_name):
        if (cand / marker).is_file():
            return cand
    return None


class _Rows(Sequence[Any]):
    """The input sequence: ``(raw 3072 bytes, label, coarse label)`` per image, built lazily."""

    def __init__(self, data: np.ndarray, labels: np.ndarray, coarse: np.ndarray | None) -> None:
        self.data, self.labels, self.coarse = data, labels, coarse

    def __len__(self) -> int:
        return int(self.data.shape[0])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return (i, self.data[i].tobytes(), int(self.labels[i]), None if self.coarse is None else int(self.coarse[i]))


class _CifarBase(Converter):
    payload = "image"
    option_defaults = {"split": None, **IMAGE_OPTIONS}
    chunk_size = 256
    detect_priority = 5
    marker = ""
    parent_name = ""
    splits: dict[str, list[str]] = {}

    def __init__(self, src: str | Path, **options: Any) -> None:
        super().__init__(src, **options)
        base = _batch_dir(self.src, self.marker, self.parent_name)
        if base is None:
            raise ConversionError(f"{self.src}: no {self.marker} found (expected a CIFAR python batch directory)")
        self.base = base
        split = self.options.get("split") or "train"
        if split not in self.splits:
            raise ConfigError(f"{self.src}: --split expected one of {', '.join(self.splits)}, found {split!r}")
        self.split = self.options["split"] = split
        self.native = self.options.get("size") is None
        self.image = ImageTransform.from_options(self.options, default_size=32)
        meta = safe_load(self.base / self.marker)
        if not isinstance(meta, dict):
            raise ConversionError(f"{self.base / self.marker}: expected a dict, found {type(meta).__name__}")
        self._meta = meta
        self._rows: _Rows | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Workers receive items with their pixels; never ship the whole corpus to each of them.
        state = self.__dict__.copy()
        state["_rows"] = None
        return state

    @classmethod
    def detect(cls, src: Path) -> bool:
        return src.is_dir() and _batch_dir(src, cls.marker, cls.parent_name) is not None

    def _load_batches(self, label_key: str, coarse_key: str | None) -> _Rows:
        datas, labels, coarse = [], [], []
        for fname in self.splits[self.split]:
            path = self.base / fname
            if not path.is_file():
                raise ConversionError(f"{path}: CIFAR batch missing")
            batch = safe_load(path)
            if not isinstance(batch, dict):
                raise ConversionError(f"{path}: expected a dict, found {type(batch).__name__}")
            data = np.asarray(_key(batch, "data", path))
            lab = np.asarray(_key(batch, label_key, path), dtype=np.int64)
            if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or lab.shape != (data.shape[0],):
                raise ConversionError(
                    f"{path}: expected data uint8 [n, 3072] and {label_key} [n], found data "
                    f"{data.dtype} {list(data.shape)} and {label_key} {list(lab.shape)}"
                )
            datas.append(data)
            labels.append(lab)
            if coarse_key:
                coarse.append(np.asarray(_key(batch, coarse_key, path), dtype=np.int64))
        return _Rows(np.concatenate(datas), np.concatenate(labels), np.concatenate(coarse) if coarse_key else None)

    def record_spec(self) -> FieldSpec:
        return FieldSpec((self.image.height, self.image.width, 3), "uint8")

    def transform(self) -> dict[str, Any]:
        return {**self.image.to_json(), "native": self.native}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "transform": self.transform()}

    def inputs_fingerprint(self, scan: ScanResult) -> str:
        rows = scan.items
        assert isinstance(rows, _Rows)
        crc = zlib.crc32(np.ascontiguousarray(rows.data).data)
        crc = zlib.crc32(rows.labels.astype("<i8").tobytes(), crc)
        if rows.coarse is not None:
            crc = zlib.crc32(rows.coarse.astype("<i8").tobytes(), crc)
        return f"{len(rows)}:{crc:08x}"

    def item_path(self, item: Any) -> str:
        return f"{self.base}[{self.split}]#{item[0]}"

    def _image(self, raw: bytes) -> np.ndarray:
        arr = np.frombuffer(raw, dtype=np.uint8).reshape(3, 32, 32).transpose(1, 2, 0)
        if self.native:
            return np.ascontiguousarray(arr)
        from PIL import Image

        out, _ = self.image.apply(Image.fromarray(np.ascontiguousarray(arr), "RGB"))
        return out


@register
class Cifar10Converter(_CifarBase):
    """CIFAR-10 python batches."""

    name = "cifar10"
    marker = "batches.meta"
    parent_name = "cifar-10-batches-py"
    splits = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}

    def scan(self) -> ScanResult:
        self._rows = self._load_batches("labels", None)
        return ScanResult(items=self._rows)

    def fields(self) -> dict[str, FieldSpec]:
        return {"label": FieldSpec((), "int64")}

    def labels(self) -> dict[str, list[str]]:
        return {"label": _names(_key(self._meta, "label_names", self.base / self.marker))}

    def decode(self, item: Any) -> list[Record]:
        return [{"image": self._image(item[1]), "label": np.int64(item[2])}]


@register
class Cifar100Converter(_CifarBase):
    """CIFAR-100 python batches (fine ``label`` and ``coarse_label``)."""

    name = "cifar100"
    marker = "meta"
    parent_name = "cifar-100-python"
    splits = {"train": ["train"], "test": ["test"]}

    @classmethod
    def detect(cls, src: Path) -> bool:
        base = _batch_dir(src, cls.marker, cls.parent_name) if src.is_dir() else None
        return base is not None and ((base / "train").is_file() or (base / "test").is_file())

    def scan(self) -> ScanResult:
        self._rows = self._load_batches("fine_labels", "coarse_labels")
        return ScanResult(items=self._rows)

    def fields(self) -> dict[str, FieldSpec]:
        return {"label": FieldSpec((), "int64"), "coarse_label": FieldSpec((), "int64")}

    def labels(self) -> dict[str, list[str]]:
        path = self.base / self.marker
        return {
            "label": _names(_key(self._meta, "fine_label_names", path)),
            "coarse_label": _names(_key(self._meta, "coarse_label_names", path)),
        }

    def decode(self, item: Any) -> list[Record]:
        return [{"image": self._image(item[1]), "label": np.int64(item[2]), "coarse_label": np.int64(item[3])}]
