"""CIFAR-10 / CIFAR-100 python batches, read with a restricted unpickler (docs/design.md §13).

:class:`SafeUnpickler` resolves only the globals plain data needs and builds arrays only from bytes the
file holds; anything else stops the run with a :class:`~shardkit.errors.ConversionError` naming the
file. ``SRC`` is the batch directory (CIFAR-10 ``data_batch_1..5``, ``test_batch``, ``batches.meta``;
CIFAR-100 ``train``, ``test``, ``meta``) or its parent. Records: ``image`` uint8 ``[H, W, 3]``,
``label`` int64 (and ``coarse_label`` for CIFAR-100); an image whose label is not a class index is a
``label`` skip.
"""

from __future__ import annotations

import builtins
import io
import math
import os
import pickle
import stat
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.converters.base import PROVENANCE, Converter, Decoded, Decoder, InputNames, ScanResult
from shardkit.converters.images import IMAGE_COLUMNS, ImageTransform, image_options
from shardkit.converters.options import Option, choice
from shardkit.errors import ConversionError, InputFileError
from shardkit.formats import FieldSpec

__all__ = ["SafeUnpickler", "safe_load", "CifarDecoder", "Cifar10Converter", "Cifar100Converter"]

#: Deepest container nesting a batch may have (real batches: a dict of lists/arrays, depth 2).
_MAX_NESTING = 64
_OPTIONS = (
    Option("split", str, None, "train or test (default train).", parse=choice("train", "test"), metavar="NAME"),
    *image_options("Output frame H or HxW in pixels (default: the native 32x32, no resizing)."),
)

#: Largest batch file read (CIFAR-100's train batch, the largest real one, is 155 MiB).
_MAX_BATCH_BYTES = 1 << 30
#: Most dimensions an unpickled array may claim (numpy itself allows 64; a CIFAR batch has 2).
_MAX_NDIM = 32
_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "str", "int", "float", "bool", "complex"}


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # Python 3 pickles bytes at protocol <= 2 as _codecs.encode(str, "latin1").
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r} is not allowed")
    return text.encode("latin1")


def _of_file_bytes(kind: type[bytes] | type[bytearray]) -> Any:
    """``kind()`` / ``kind(b"...")`` only: ``bytes(10**10)`` would allocate what the file never held."""

    def make(*args: Any) -> bytes | bytearray:
        if not args or (len(args) == 1 and isinstance(args[0], (bytes, bytearray))):
            return kind(*args)
        raise pickle.UnpicklingError(f"{kind.__name__}() of {type(args[0]).__name__} is not allowed (only of bytes in the file)")

    return make


def _claimed_shape(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints, at most :data:`_MAX_NDIM` of them (nothing allocated)."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or len(shape) > _MAX_NDIM:
        raise pickle.UnpicklingError(f"an array claims shape {shape!r:.80}; expected a tuple of at most {_MAX_NDIM} sizes")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in shape):
        raise pickle.UnpicklingError(f"an array claims shape {list(shape)!r:.80}; expected non-negative integer sizes")
    return tuple(shape)


def _array_from_bytes(data: Any, dtype: Any, shape: Any, fortran: bool) -> np.ndarray:
    """The array of ``shape`` and ``dtype`` made of exactly the bytes ``data`` read from the file (the
    claimed size, a Python int, must equal ``len(data)`` before anything is allocated)."""
    if not isinstance(dtype, np.dtype):
        raise pickle.UnpicklingError(f"an array's dtype is a {type(dtype).__name__}, expected a numpy dtype")
    if dtype.hasobject:
        raise pickle.UnpicklingError(f"an array of dtype {dtype} holds Python objects")
    dims = _claimed_shape(shape)
    if isinstance(data, pickle.PickleBuffer):
        data = data.raw()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise pickle.UnpicklingError(f"an array's data is a {type(data).__name__}, expected bytes")
    count = math.prod(dims)
    claimed = count * dtype.itemsize
    found = memoryview(data).nbytes
    if count and not dtype.itemsize:
        raise pickle.UnpicklingError(f"an array claims {count} items of the zero-size dtype {dtype}")
    if claimed != found:
        raise pickle.UnpicklingError(
            f"an array claims shape {list(dims)} of {dtype} ({claimed} bytes) but holds {found} bytes of data")
    flat = np.frombuffer(data, dtype=dtype, count=count) if count else np.zeros(0, dtype=dtype)
    return flat.reshape(dims, order="F" if fortran else "C").copy(order="K")


class _NdarrayType:
    """What ``numpy.ndarray`` resolves to: only the type argument of ``_reconstruct`` (calling it would
    allocate memory of a size the file merely claims)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise pickle.UnpicklingError("numpy.ndarray(...) is not allowed (it allocates memory the file does not hold)")


_NDARRAY = _NdarrayType()


class _PendingArray:
    """What ``_reconstruct`` returns: no memory yet. Pickle's BUILD hands it the array's state
    ``(version, shape, dtype, is_fortran, data)``, from which :func:`_array_from_bytes` makes the
    array; :func:`_resolve` puts the array where the stand-in was."""

    __slots__ = ("array",)

    def __init__(self) -> None:
        self.array: np.ndarray | None = None

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise pickle.UnpicklingError(f"an array's state is a {type(state).__name__}, expected (shape, dtype, fortran, data)")
        shape, dtype, fortran, data = state[-4:]
        self.array = _array_from_bytes(data, dtype, shape, bool(fortran))


def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> _PendingArray:
    """Stand-in for ``numpy._core.multiarray._reconstruct``, which allocates ``shape`` uninitialised."""
    if subtype is not _NDARRAY:
        raise pickle.UnpicklingError(f"_reconstruct of {type(subtype).__name__} is not allowed (only numpy.ndarray)")
    _claimed_shape(shape)
    return _PendingArray()


def _frombuffer(buf: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
    """Stand-in for ``numpy._core.numeric._frombuffer`` (pickle protocol 5), sizes checked first."""
    return _array_from_bytes(buf, dtype, shape, order == "F")


def _scalar(dtype: Any, data: Any = None) -> Any:
    """Stand-in for ``numpy._core.multiarray.scalar``: one item made of exactly ``dtype.itemsize`` bytes."""
    return _array_from_bytes(data, dtype, (), False)[()]


#: The globals a batch may name, and what each resolves to: numpy's array constructors are replaced by
#: checked stand-ins (they would allocate the claimed shape), ``bytes``/``bytearray`` likewise.
_GLOBALS: dict[tuple[str, str], Any] = {
    **{(f"numpy.{core}.multiarray", "_reconstruct"): _reconstruct for core in ("core", "_core")},
    **{(f"numpy.{core}.multiarray", "scalar"): _scalar for core in ("core", "_core")},
    **{(f"numpy.{core}.numeric", "_frombuffer"): _frombuffer for core in ("core", "_core")},
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
    **{(mod, kind.__name__): _of_file_bytes(kind) for mod in ("builtins", "__builtin__") for kind in (bytes, bytearray)},
    **{(mod, name): getattr(builtins, name) for mod in ("builtins", "__builtin__") for name in _BUILTINS},
}


class SafeUnpickler(pickle.Unpickler):
    """Unpickler that allows only plain containers, bytes and numpy arrays/dtypes; call :func:`safe_load`
    (which also replaces the arrays' stand-ins) rather than ``load`` directly."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed") from None


def _resolve(obj: Any, path: Path) -> Any:
    """``obj`` with every array stand-in replaced by its array; object arrays, arrays that never got
    their data and nesting deeper than a real batch are refused. Each object is visited once."""
    done: dict[int, Any] = {}

    def visit(value: Any, depth: int) -> Any:
        if id(value) in done:
            return done[id(value)]
        if isinstance(value, _PendingArray):
            if value.array is None:
                raise ConversionError(f"{path}: an array without its data (pickle stopped before the array's state)")
            out: Any = value.array
        elif isinstance(value, np.ndarray) and value.dtype.hasobject:
            raise ConversionError(f"{path}: refused to load an object array (pickle can execute code)")
        elif isinstance(value, (dict, list, tuple, set, frozenset)):
            if depth >= _MAX_NESTING:
                raise ConversionError(f"{path}: containers nested more than {_MAX_NESTING} levels deep; not a CIFAR batch")
            if isinstance(value, dict):
                items = [(visit(k, depth + 1), visit(v, depth + 1)) for k, v in value.items()]
                if any(isinstance(k, np.ndarray) for k, _ in items):
                    raise ConversionError(f"{path}: an array used as a dict key; not a CIFAR batch")
                out = dict(items)
            else:
                try:
                    out = type(value)(visit(x, depth + 1) for x in value)
                except TypeError:  # an array in a set
                    raise ConversionError(f"{path}: an array inside a set; not a CIFAR batch") from None
        else:
            out = value
        done[id(value)] = out
        return out

    return visit(obj, 0)


def _read_batch(path: Path) -> bytes:
    """The bytes of a batch file: a regular file (a FIFO or a device would never end) of at most
    :data:`_MAX_BATCH_BYTES`, checked before reading."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ConversionError(f"{path}: cannot read the CIFAR batch: {exc}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConversionError(f"{path}: expected a regular file holding a CIFAR batch, found a special file")
        if st.st_size > _MAX_BATCH_BYTES:
            raise ConversionError(f"{path}: {st.st_size} bytes; a CIFAR batch has at most {_MAX_BATCH_BYTES} "
                                  "(the largest real one, CIFAR-100 train, is 155 MiB)")
        try:
            data = fh.read(_MAX_BATCH_BYTES + 1)
        except OSError as exc:
            raise ConversionError(f"{path}: cannot read the CIFAR batch: {exc}") from None
    if len(data) > _MAX_BATCH_BYTES:  # grew since it was checked
        raise ConversionError(f"{path}: more than {_MAX_BATCH_BYTES} bytes; not a CIFAR batch")
    return data


def safe_load(path: Path) -> Any:
    """Unpickle ``path`` with :class:`SafeUnpickler` (``ConversionError`` naming the file on refusal)."""
    data = _read_batch(path)
    try:
        obj = SafeUnpickler(io.BytesIO(data), encoding="bytes").load()
    except RecursionError:
        raise ConversionError(f"{path}: nested too deeply to unpickle; not a CIFAR batch") from None
    except pickle.UnpicklingError as exc:
        raise ConversionError(
            f"{path}: refused to unpickle: {exc}; only plain containers, bytes and numpy arrays are "
            "allowed, because pickle can execute code"
        ) from None
    except Exception as exc:
        raise ConversionError(f"{path}: not a readable CIFAR python batch ({type(exc).__name__}: {exc})") from None
    return _resolve(obj, path)


def _key(d: dict[Any, Any], name: str, path: Path) -> Any:
    for k in (name, name.encode()):
        if k in d:
            return d[k]
    raise ConversionError(f"{path}: expected a dict with key {name!r}, found keys {sorted(map(str, d))[:8]}")


def _names(values: Any, path: Path, key: str) -> list[str]:
    """Class names from a list of str/bytes (ConversionError naming the file otherwise)."""
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, (str, bytes)) for v in values):
        raise ConversionError(f"{path}: expected {key} to be a list of names, found {type(values).__name__}")
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else v for v in values]
    except UnicodeDecodeError as exc:
        raise ConversionError(f"{path}: {key} holds a name that is not UTF-8 ({exc})") from None


def _int_labels(values: Any, path: Path, key: str, n: int) -> tuple[np.ndarray, dict[int, str]]:
    """``n`` labels as int64 (-1 for a bad entry), and ``{row: what was found}`` for entries that are not
    int64 integers; the whole must be a list or 1-D integer array of ``n`` entries."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu" and values.shape == (n,):
        if values.dtype.kind == "u" and values.dtype.itemsize == 8 and n and values.max() > np.iinfo(np.int64).max:
            values = list(values.tolist())  # uint64 beyond int64: check entry by entry
        else:
            return values.astype(np.int64), {}
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != n:
        found = f"{len(values)} entries" if isinstance(values, (list, tuple, np.ndarray)) else type(values).__name__
        raise ConversionError(f"{path}: expected {key} to be a list of {n} labels, found {found}")
    out = np.full(n, -1, dtype=np.int64)
    bad: dict[int, str] = {}
    for i, v in enumerate(values.tolist() if isinstance(values, np.ndarray) else values):
        if isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63:
            out[i] = v
        else:
            text = repr(v)
            bad[i] = text if len(text) <= 40 else text[:37] + "..."
    return out, bad


def _batch_dir(src: Path, marker: str, parent_name: str) -> Path | None:
    for cand in (src, src / parent_name):
        if (cand / marker).is_file():
            return cand
    return None


class _Rows(Sequence[Any]):
    """The input sequence, built lazily: ``(row, raw 3072 bytes, label, coarse label, "batch#index")`` per
    image; a label that was not an integer is the text found (the decoder skips its image)."""

    def __init__(self, data: np.ndarray, labels: np.ndarray, coarse: np.ndarray | None,
                 bad: dict[int, str], bad_coarse: dict[int, str], batches: list[tuple[str, int]]) -> None:
        self.data, self.labels, self.coarse = data, labels, coarse
        self.bad, self.bad_coarse = bad, bad_coarse
        self.batches = batches
        self._starts = np.array([start for _, start in batches], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.data.shape[0])

    def name(self, i: int) -> str:
        """``batch file#index in it`` of row ``i``."""
        b = int(np.searchsorted(self._starts, i, side="right")) - 1
        fname, start = self.batches[b]
        return f"{fname}#{i - start}"

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        label: int | str = self.bad.get(i, int(self.labels[i]))
        coarse: int | str | None = None if self.coarse is None else self.bad_coarse.get(i, int(self.coarse[i]))
        return (i, self.data[i].tobytes(), label, coarse, self.name(i))


class CifarDecoder(Decoder):
    """Decode one row: the 3072 planar bytes into an image, labels checked against the class names."""

    def __init__(self, image: ImageTransform, native: bool, where: str, classes: int, coarse_classes: int | None) -> None:
        super().__init__("image", FieldSpec((image.height, image.width, 3), "uint8"))
        self.image = image
        self.native = native
        self.where = where
        self.classes = classes
        self.coarse_classes = coarse_classes

    def item_path(self, item: Any) -> str:
        return f"{self.where}/{item[4]}"

    def _label(self, item: Any, value: int | str, classes: int, name: str) -> np.int64:
        if isinstance(value, str) or not 0 <= value < classes:
            raise InputFileError(self.item_path(item), f"label: {name} {value} is not one of the {classes} classes "
                                 f"(expected 0..{classes - 1})")
        return np.int64(value)

    def decode(self, item: Any, start: int = 0) -> Decoded:
        record: dict[str, Any] = {"label": self._label(item, item[2], self.classes, "label")}
        if self.coarse_classes is not None:
            record["coarse_label"] = self._label(item, item[3], self.coarse_classes, "coarse label")
        arr = np.frombuffer(item[1], dtype=np.uint8).reshape(3, 32, 32).transpose(1, 2, 0)
        if self.native:
            record["image"] = np.ascontiguousarray(arr)
        else:
            from PIL import Image

            record["image"], _ = self.image.apply(Image.fromarray(np.ascontiguousarray(arr), "RGB"))
        record[PROVENANCE] = {"width": 32, "height": 32, "orientation": 1, "flags": 0, "reduce": 1}
        return Decoded([record])


class _CifarBase(Converter):
    """What CIFAR-10 and CIFAR-100 share; subclasses name their files and keys."""

    payload = "image"
    options = _OPTIONS
    chunk_size = 256
    detect_priority = 5
    progress_unit = "img"
    one_record_per_input = True
    provenance_columns = IMAGE_COLUMNS
    marker = ""
    parent_name = ""
    splits: dict[str, list[str]] = {}
    #: Batch keys of the labels (fine, coarse) and meta keys of their names; ``None``: no coarse labels.
    label_key = ""
    names_key = ""
    coarse_key: str | None = None
    coarse_names_key: str | None = None

    def __init__(self, src: str | Path, **options: Any) -> None:
        super().__init__(src, **options)
        base = _batch_dir(self.src, self.marker, self.parent_name)
        if base is None:
            raise ConversionError(f"{self.src}: no {self.marker} found (expected a CIFAR python batch directory)")
        self.base = base
        self.split = self.values["split"] = self.values.get("split") or "train"
        self.native = self.values.get("size") is None
        self.image = ImageTransform.from_options(self.values, self.label, default_size=32)
        meta_path = self.base / self.marker
        meta = safe_load(meta_path)
        if not isinstance(meta, dict):
            raise ConversionError(f"{meta_path}: expected a dict, found {type(meta).__name__}")
        self.names = {"label": _names(_key(meta, self.names_key, meta_path), meta_path, self.names_key)}
        if self.coarse_key is not None and self.coarse_names_key is not None:
            self.names["coarse_label"] = _names(_key(meta, self.coarse_names_key, meta_path), meta_path, self.coarse_names_key)

    @classmethod
    def detect(cls, src: Path) -> bool:
        return src.is_dir() and _batch_dir(src, cls.marker, cls.parent_name) is not None

    def _load_batch(self, path: Path) -> tuple[np.ndarray, tuple[np.ndarray, dict[int, str]], tuple[np.ndarray, dict[int, str]] | None]:
        if not path.is_file():
            raise ConversionError(f"{path}: CIFAR batch missing")
        batch = safe_load(path)
        if not isinstance(batch, dict):
            raise ConversionError(f"{path}: expected a dict, found {type(batch).__name__}")
        data = np.asarray(_key(batch, "data", path))
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
            raise ConversionError(f"{path}: expected data uint8 [n, 3072], found {data.dtype} {list(data.shape)}")
        n = data.shape[0]
        labels = _int_labels(_key(batch, self.label_key, path), path, self.label_key, n)
        coarse = None
        if self.coarse_key is not None:
            coarse = _int_labels(_key(batch, self.coarse_key, path), path, self.coarse_key, n)
        return data, labels, coarse

    def scan(self) -> ScanResult:
        datas, labels, coarse = [], [], []
        bad: dict[int, str] = {}
        bad_coarse: dict[int, str] = {}
        offset = 0
        batches = []
        for fname in self.splits[self.split]:
            batches.append((fname, offset))
            data, (lab, lab_bad), coarse_part = self._load_batch(self.base / fname)
            datas.append(data)
            labels.append(lab)
            bad.update({offset + k: v for k, v in lab_bad.items()})
            if coarse_part is not None:
                coarse.append(coarse_part[0])
                bad_coarse.update({offset + k: v for k, v in coarse_part[1].items()})
            offset += data.shape[0]
        rows = _Rows(np.concatenate(datas), np.concatenate(labels),
                     np.concatenate(coarse) if self.coarse_key else None, bad, bad_coarse, batches)
        return ScanResult(items=rows)

    def fields(self) -> dict[str, FieldSpec]:
        return {name: FieldSpec((), "int64") for name in self.names}

    def labels(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self.names.items()}

    def record_spec(self) -> FieldSpec:
        return FieldSpec((self.image.height, self.image.width, 3), "uint8")

    def make_decoder(self) -> CifarDecoder:
        coarse = self.names.get("coarse_label")
        return CifarDecoder(self.image, self.native, str(self.base), len(self.names["label"]),
                            None if coarse is None else len(coarse))

    def transform(self) -> dict[str, Any]:
        return {**self.image.to_json(), "native": self.native}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "transform": self.transform()}

    def input_names(self, items: Sequence[Any]) -> Sequence[str]:
        """Names without building the items (which copy each image's bytes)."""
        if not isinstance(items, _Rows):
            return super().input_names(items)
        prefix = self.input_name((0, b"", 0, None, ""))
        return InputNames(len(items), lambda i: prefix + items.name(i))

    def inputs_fingerprint(self, scan: ScanResult) -> str:
        rows = scan.items
        if not isinstance(rows, _Rows):
            raise TypeError(f"expected the rows of {type(self).__name__}.scan(), found {type(rows).__name__}")
        crc = zlib.crc32(np.ascontiguousarray(rows.data).data)
        crc = zlib.crc32(rows.labels.astype("<i8").tobytes(), crc)
        if rows.coarse is not None:
            crc = zlib.crc32(rows.coarse.astype("<i8").tobytes(), crc)
        crc = zlib.crc32(repr(sorted(rows.bad.items()) + sorted(rows.bad_coarse.items())).encode(), crc)
        return f"{len(rows)}:{crc:08x}"


class Cifar10Converter(_CifarBase):
    """CIFAR-10 python batches."""

    name = "cifar10"
    marker = "batches.meta"
    parent_name = "cifar-10-batches-py"
    splits = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
    label_key = "labels"
    names_key = "label_names"


class Cifar100Converter(_CifarBase):
    """CIFAR-100 python batches (fine ``label`` and ``coarse_label``)."""

    name = "cifar100"
    marker = "meta"
    parent_name = "cifar-100-python"
    splits = {"train": ["train"], "test": ["test"]}
    label_key = "fine_labels"
    names_key = "fine_label_names"
    coarse_key = "coarse_labels"
    coarse_names_key = "coarse_label_names"

    @classmethod
    def detect(cls, src: Path) -> bool:
        base = _batch_dir(src, cls.marker, cls.parent_name) if src.is_dir() else None
        return base is not None and ((base / "train").is_file() or (base / "test").is_file())
