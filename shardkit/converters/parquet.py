"""Parquet files, Hugging Face datasets among them: a ``.parquet`` file or a directory of them, or the
Arrow files of ``datasets``' ``save_to_disk`` (``data-00000-of-00001.arrow``, read memory-mapped).

One row is one input. The payload column holds images (a ``{bytes, path}`` struct as Hugging Face's
``Image`` stores it, or raw bytes) or audio (``Audio``'s ``{bytes, path}``), transformed by the image or
audio options; ``label`` is an integer column whose class names come from the schema's Hugging Face
``ClassLabel`` metadata (the ``huggingface`` key of the Arrow schema metadata) when present; other
numeric scalar columns become fields; other columns are dropped and counted. Every file must have the
columns the first one has, with the same types, or the conversion stops naming the file and column.
Row groups are read one at a time (a worker keeps the last one), each bounded in size; a file of a
split layout (``train-00000-of-00004.parquet``, ``data/train/...``) belongs to that split.
Provenance: the file's name, ``#`` and the row number in the file.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardkit._extras import import_extra
from shardkit.converters.audio import AUDIO_OPTIONS
from shardkit.converters.audio_transforms import AUDIO_COLUMNS, AudioTransform
from shardkit.converters.base import PROVENANCE, RECORD_BYTES_PER_CALL, Converter, Decoded, Decoder, Note, ScanResult
from shardkit.converters.classfolders import SPLIT_NAMES, choose_split
from shardkit.converters.images import IMAGE_COLUMNS, IMAGE_OPTIONS, ImageTransform
from shardkit.converters.layout import RecordLayout
from shardkit.converters.options import Option, choice, count, text
from shardkit.errors import ConfigError, ConversionError, InputFileError
from shardkit.formats import FieldSpec
from shardkit.formats.provenance import ENDS_ARRAY, NAMES_ARRAY, PROVENANCE_FIELD

__all__ = ["ParquetConverter", "ParquetDecoder", "hf_features"]

logger = logging.getLogger(__name__)

#: Largest row group read (its uncompressed size as the file's footer states it); a worker holds one.
MAX_ROW_GROUP_BYTES = 1 << 30
#: Most classes an integer label column without class names may imply.
_MAX_CLASSES = 1 << 20
_FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_RESERVED = frozenset({"image", "audio", "key", "label", PROVENANCE_FIELD, NAMES_ARRAY, ENDS_ARRAY})
_SPLIT_FILE = re.compile(r"([A-Za-z]+)-\d+-of-\d+\.parquet")
#: File name endings read: Parquet, and the Arrow stream files ``save_to_disk`` writes.
_SUFFIXES = (".parquet", ".arrow")

_OPTIONS = (
    Option("split", str, None, "A split of a Hugging Face layout (train-00000-of-00002.parquet or data/train/; "
           "default train, or every file when there is no split).", parse=text, metavar="NAME"),
    Option("column", str, None, "The payload column (default: the first Image or Audio column, else the first "
           "{bytes, path} struct or binary column).", parse=text, metavar="NAME"),
    Option("label_column", str, None, "The integer class column (default: label, or the first ClassLabel column).",
           parse=text, metavar="NAME"),
    Option("media", str, None, "image or audio records (default: from the Hugging Face feature, else image).",
           parse=choice("image", "audio"), metavar="KIND"),
    Option("max_row_group_bytes", int, MAX_ROW_GROUP_BYTES, "Largest row group read, uncompressed (a worker holds "
           "one).", parse=count(1), metavar="N"),
    *IMAGE_OPTIONS,
    *AUDIO_OPTIONS,
)


def _pq() -> Any:
    return import_extra("pyarrow.parquet", "parquet", needed_by="shardkit's parquet corpus kind")


def hf_features(schema: Any) -> dict[str, Any]:
    """The ``features`` Hugging Face ``datasets`` records in an Arrow schema's metadata
    (``{"info": {"features": {column: {"_type": ...}}}}`` under the key ``huggingface``), or ``{}``."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
        features = doc["info"]["features"]
    except (ValueError, KeyError, TypeError):
        logger.warning("the schema's huggingface metadata is not datasets' {info: {features: ...}}; ignored")
        return {}
    return features if isinstance(features, dict) else {}


def _parquet_files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(_SUFFIXES) and not f.startswith(".")]
    return out


def _arrow_batches(path: Path | str) -> list[Any]:
    """The record batches of an Arrow stream (or file) written by ``datasets``, memory-mapped (no copy)."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        return list(pa.ipc.open_stream(source))
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        return [reader.get_batch(i) for i in range(reader.num_record_batches)]


def _file_schema(path: Path) -> Any:
    if path.suffix == ".arrow":
        import pyarrow as pa

        return pa.ipc.open_stream(pa.memory_map(str(path))).schema
    return _pq().read_schema(path)


def _file_groups(path: Path) -> list[tuple[int, int]]:
    """``(rows, uncompressed bytes)`` of every row group (record batch for an Arrow file)."""
    if path.suffix == ".arrow":
        return [(b.num_rows, b.nbytes) for b in _arrow_batches(path)]
    meta = _pq().ParquetFile(path).metadata
    return [(meta.row_group(rg).num_rows, meta.row_group(rg).total_byte_size) for rg in range(meta.num_row_groups)]


def _read_group(path: str, rg: int, columns: list[str]) -> Any:
    """The ``columns`` of row group ``rg`` of ``path`` as a table."""
    if path.endswith(".arrow"):
        import pyarrow as pa

        return pa.Table.from_batches([_arrow_batches(path)[rg]]).select(columns)
    return _pq().ParquetFile(path).read_row_group(rg, columns=columns)


def _split_of(rel: Path) -> str | None:
    m = _SPLIT_FILE.fullmatch(rel.name)
    if m:
        return m.group(1)
    return next((p for p in rel.parts[:-1] if p in SPLIT_NAMES), None)


def _is_bytes(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t))


def _is_media_struct(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_struct(t) and t.get_field_index("bytes") >= 0 and _is_bytes(t.field("bytes").type))


def _scalar_dtype(t: Any) -> str | None:
    import pyarrow as pa

    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return str(np.dtype(t.to_pandas_dtype()).name)
    return None


@dataclass(frozen=True)
class _Layout:
    """The columns read: payload, label (or ``None``), numeric fields (column -> dtype) and dropped ones."""

    media: str
    column: str
    label: str | None
    numbers: dict[str, str]
    dropped: tuple[str, ...]


class _Rows(Sequence[tuple[int, int, int]]):
    """Every row as ``(file, row group, row in the file)``, made from the row groups' starts when asked."""

    def __init__(self, groups: list[tuple[int, int, int]], ends: list[int]) -> None:
        self.groups, self.ends = groups, ends  # (file, row group, first row in file); cumulative row ends

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        i %= len(self)
        g = bisect.bisect_right(self.ends, i)
        f, rg, first = self.groups[g]
        return f, rg, first + i - (self.ends[g - 1] if g else 0)


class ParquetDecoder(Decoder):
    """Decode one row; keeps the last row group read (rows arrive in order)."""

    def __init__(self, record: FieldSpec, files: list[str], starts: list[list[int]], layout: _Layout,
                 image: ImageTransform | None, audio: AudioTransform | None) -> None:
        super().__init__(layout.media, record)
        self.files, self.starts, self.layout, self.image, self.audio = files, starts, layout, image, audio
        self.per_call = max(1, RECORD_BYTES_PER_CALL // record.nbytes)
        self._cache: tuple[tuple[int, int], Any] | None = None
        #: The numeric columns of the first file, enforced on every row.
        self.enforced = RecordLayout({c: FieldSpec((), d) for c, d in layout.numbers.items()})

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": None}

    def item_path(self, item: tuple[int, int, int]) -> str:
        return f"{self.files[item[0]]}#{item[2]}"

    def _group(self, f: int, rg: int) -> Any:
        if self._cache is None or self._cache[0] != (f, rg):
            self._cache = None
            lay = self.layout
            columns = [lay.column, *([lay.label] if lay.label else []), *lay.numbers]
            try:
                table = _read_group(self.files[f], rg, columns)
            except Exception as exc:  # pyarrow raises OSError and ArrowException subclasses for damaged data
                raise InputFileError(f"{self.files[f]}#rg{rg}", f"corrupt: cannot read row group {rg}: {exc}") from None
            self._cache = ((f, rg), table)
        return self._cache[1]

    def decode(self, item: tuple[int, int, int], start: int = 0) -> Decoded:
        f, rg, row = item
        where = self.item_path(item)
        table = self._group(f, rg)
        i = row - self.starts[f][rg]
        lay = self.layout
        value = table.column(lay.column)[i].as_py()
        data = value.get("bytes") if isinstance(value, dict) else value
        if data is None:
            path = value.get("path") if isinstance(value, dict) else None
            raise InputFileError(where, f"missing: {lay.column} holds no bytes" + (f" (only the path {path!r})" if path else ""))
        fields: dict[str, Any] = {}
        if lay.label is not None:
            label = table.column(lay.label)[i].as_py()
            if label is None or label < 0:
                raise InputFileError(where, f"label: {lay.label} is {label!r}")
            fields["label"] = np.int64(label)
        else:
            fields["label"] = np.int64(0)
        numbers = {}
        for name in lay.numbers:
            numbers[name] = table.column(name)[i].as_py()
            if numbers[name] is None:
                raise InputFileError(where, f"missing: {name} is null")
        fields.update(self.enforced.check(numbers, where, "the row"))
        notes = tuple(Note(f"dropped column {c}", "not an image, audio, label or numeric column; not kept")
                      for c in lay.dropped) if start == 0 else ()
        named = Path(f"{where}.{lay.column}")
        if lay.media == "image":
            assert self.image is not None
            loaded = self.image.load(named, bytes(data))
            return Decoded([{"image": loaded.array, **fields, PROVENANCE: {"row": row, **loaded.provenance()}}], notes=notes)
        assert self.audio is not None
        clips = self.audio.read(named, start, self.per_call, data=bytes(data))
        source = {"row": row, **clips.provenance()}
        return Decoded([{"audio": c, **fields, PROVENANCE: source} for c in clips.records], start, clips.more, notes=notes)


class ParquetConverter(Converter):
    """Convert Parquet files (see the module docstring)."""

    name = "parquet"
    options = _OPTIONS
    detect_priority = 10
    chunk_size = 16
    progress_unit = "row"

    def __init__(self, src: str | Path, **options: Any) -> None:
        super().__init__(src, **options)
        v = self.values
        self.image = ImageTransform.from_options(v, self.label)
        if round(v["duration"] * v["sample_rate"]) < 1:
            raise ConfigError(f"{self.label('duration')} {v['duration']} at {self.label('sample_rate')} "
                              f"{v['sample_rate']} is less than one sample")
        self.audio = AudioTransform(v["sample_rate"], v["duration"], v["channels"], v["window"], v["dtype"])
        root = self.src if self.src.is_dir() else self.src.parent
        files = _parquet_files(self.src)
        if not files:
            raise ConversionError(f"{self.src}: no .parquet (or save_to_disk .arrow) files")
        splits = sorted({s for s in (_split_of(p.relative_to(root)) for p in files) if s})
        self.split = choose_split(splits, v.get("split"), self.src, self.label("split")) if splits else None
        if v.get("split") is not None and not splits:
            raise ConfigError(f"{self.src}: {self.label('split')} {v['split']!r} not found; the files name no split")
        self.values["split"] = self.split
        self.files = [p for p in files if self.split is None or _split_of(p.relative_to(root)) == self.split]
        self.root = root
        self.layout, self._classes = self._plan()
        self._scanned: ScanResult | None = None

    @classmethod
    def detect(cls, src: Path) -> bool:
        """A ``.parquet`` file, or a directory whose first files (a few levels down) are mostly Parquet."""
        if src.is_file():
            return src.suffix in _SUFFIXES
        if not src.is_dir():
            return False
        seen = parquet = 0
        for _dirpath, dirnames, filenames in os.walk(src):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for f in filenames:
                if f.startswith(".") or f.endswith((".json", ".md", ".txt", ".lock")):
                    continue
                seen += 1
                parquet += f.endswith(_SUFFIXES)
            if seen >= 50:
                break
        return parquet > 0 and parquet * 2 > seen

    # ------------------------------------------------------------------ schema
    def _schema(self, path: Path) -> Any:
        try:
            return _file_schema(path)
        except ConversionError:
            raise
        except Exception as exc:
            if type(exc).__name__ == "MissingExtraError":
                raise
            raise ConversionError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None

    def _plan(self) -> tuple[_Layout, list[str]]:
        """The columns to read, from the first file's schema and the options; class names."""
        first = self.files[0]
        schema = self._schema(first)
        features = hf_features(schema)
        names = list(schema.names)
        v = self.values
        column = v["column"]
        if column is None:
            column = next((c for c in names if isinstance(features.get(c), dict)
                           and features[c].get("_type") in ("Image", "Audio")), None)
            column = column or next((c for c in names if _is_media_struct(schema.field(c).type)), None)
            column = column or next((c for c in names if _is_bytes(schema.field(c).type)), None)
            if column is None:
                raise ConversionError(f"{first}: no image or audio column (a {{bytes, path}} struct or binary); "
                                      f"columns: {', '.join(names)}")
        elif column not in names:
            raise ConversionError(f"{first}: no column {column!r}; columns: {', '.join(names)}")
        found = features.get(column)
        feature: dict[str, Any] = found if isinstance(found, dict) else {}
        media = v["media"] or ("audio" if feature.get("_type") == "Audio" else "image")
        label = v["label_column"]
        if label is None:
            label = "label" if "label" in names else next(
                (c for c in names if isinstance(features.get(c), dict) and features[c].get("_type") == "ClassLabel"), None)
        elif label not in names:
            raise ConversionError(f"{first}: no column {label!r}; columns: {', '.join(names)}")
        numbers: dict[str, str] = {}
        dropped = []
        for c in names:
            if c in (column, label):
                continue
            dtype = _scalar_dtype(schema.field(c).type)
            if dtype is not None and _FIELD_NAME.fullmatch(c) and c not in _RESERVED:
                numbers[c] = dtype
            else:
                dropped.append(c)
        layout = _Layout(media, column, label, numbers, tuple(dropped))
        for path in self.files:
            self._check(path, schema if path == first else self._schema(path), layout)
        classes: list[str] = []
        if label is not None:
            fl = features.get(label)
            if isinstance(fl, dict) and isinstance(fl.get("names"), list):
                classes = [str(n) for n in fl["names"]]
            else:
                classes = self._numbered_classes(label)
        return layout, classes

    def _check(self, path: Path, schema: Any, layout: _Layout) -> None:
        """ConversionError naming ``path`` and the column when a column is missing or of another type."""
        def need(column: str, ok: bool, expected: str) -> None:
            if column not in schema.names:
                raise ConversionError(f"{path}: missing column {column!r} (the first file {self.files[0].name} has "
                                      f"it); columns: {', '.join(schema.names)}")
            if not ok:
                raise ConversionError(f"{path}: column {column!r} is {schema.field(column).type}, expected {expected}")

        t = schema.field(layout.column).type if layout.column in schema.names else None
        need(layout.column, t is not None and (_is_media_struct(t) or _is_bytes(t)), "a {bytes, path} struct or binary")
        if layout.label is not None:
            import pyarrow as pa

            lt = schema.field(layout.label).type if layout.label in schema.names else None
            need(layout.label, lt is not None and pa.types.is_integer(lt), "an integer class column")
        for c, dtype in layout.numbers.items():
            ct = schema.field(c).type if c in schema.names else None
            need(c, ct is not None and _scalar_dtype(ct) == dtype, dtype)

    def _numbered_classes(self, label: str) -> list[str]:
        """``"0"``.. up to the largest label (from the footer statistics, else reading the column)."""
        top = -1
        for path in self.files:
            if path.suffix == ".arrow":
                for batch in _arrow_batches(path):
                    values = batch.column(batch.schema.get_field_index(label)).to_pylist()
                    top = max(top, int(max((x for x in values if x is not None), default=-1)))
                continue
            pf = _pq().ParquetFile(path)
            for rg in range(pf.metadata.num_row_groups):
                group = pf.metadata.row_group(rg)
                leaf = next(j for j in range(group.num_columns) if group.column(j).path_in_schema == label)
                stats = group.column(leaf).statistics
                if stats is not None and stats.has_min_max:
                    top = max(top, int(stats.max))
                else:
                    values = pf.read_row_group(rg, columns=[label]).column(label)
                    top = max(top, int(max((x for x in values.to_pylist() if x is not None), default=-1)))
        if top >= _MAX_CLASSES:
            raise ConversionError(f"{self.src}: {label} reaches {top}, beyond {_MAX_CLASSES - 1} classes without "
                                  "ClassLabel names; is it a class column?")
        return [str(i) for i in range(top + 1)]

    # ------------------------------------------------------------------ scanning
    def scan(self) -> ScanResult:
        """Every row, file by file and row group by row group (footers only; bounded row groups)."""
        if self._scanned is not None:
            return self._scanned
        groups: list[tuple[int, int, int]] = []
        ends: list[int] = []
        self.starts: list[list[int]] = []
        limit = self.values["max_row_group_bytes"]
        total = 0
        for f, path in enumerate(self.files):
            try:
                found = _file_groups(path)
            except Exception as exc:
                raise ConversionError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
            first, starts = 0, []
            for rg, (rows, nbytes) in enumerate(found):
                if nbytes > limit:
                    raise ConversionError(f"{path}: row group {rg} holds {nbytes} bytes uncompressed, more "
                                          f"than {self.label('max_row_group_bytes')} {limit}")
                starts.append(first)
                if rows:
                    groups.append((f, rg, first))
                    total += rows
                    ends.append(total)
                first += rows
            self.starts.append(starts)
        if not total:
            raise ConversionError(f"{self.src}: the Parquet files hold no rows")
        self._scanned = ScanResult(items=_Rows(groups, ends))
        return self._scanned

    # ------------------------------------------------------------------ what a record is
    @property
    def payload(self) -> str:  # type: ignore[override]
        """``image`` or ``audio``, as the payload column's feature (or ``media``) says."""
        return self.layout.media

    @property
    def provenance_columns(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("row", *(IMAGE_COLUMNS if self.layout.media == "image" else AUDIO_COLUMNS))

    def source_root(self) -> Path:
        return self.root

    def record_spec(self) -> FieldSpec:
        if self.layout.media == "image":
            return FieldSpec((self.image.height, self.image.width, 3), "uint8")
        return FieldSpec(self.audio.shape, self.audio.dtype)

    def fields(self) -> dict[str, FieldSpec]:
        return {"label": FieldSpec((), "int64"), **{c: FieldSpec((), d) for c, d in self.layout.numbers.items()}}

    def labels(self) -> dict[str, list[str]]:
        return {"label": list(self._classes)}

    def transform(self) -> dict[str, Any]:
        return dict(self.image.to_json() if self.layout.media == "image" else self.audio.to_json())

    def config(self) -> dict[str, Any]:
        lay = self.layout
        return {**super().config(), "transform": self.transform(), "classes": self._classes,
                "columns": {"payload": lay.column, "label": lay.label, "numbers": lay.numbers}}

    def make_decoder(self) -> ParquetDecoder:
        self.scan()
        lay = self.layout
        return ParquetDecoder(self.record_spec(), [str(p) for p in self.files], self.starts, lay,
                              self.image if lay.media == "image" else None, self.audio if lay.media == "audio" else None)

    def inputs_fingerprint(self, scan: ScanResult) -> str:
        """The files, their sizes and row counts (naming every row would read nothing new)."""
        import zlib

        crc = 0
        for path in self.files:
            crc = zlib.crc32(f"{path}\t{path.stat().st_size}\n".encode("utf-8", "surrogateescape"), crc)
        return f"{len(scan.items)}:{crc:08x}"
