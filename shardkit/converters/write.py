"""``shardkit.write(fn, inputs, out)``: a dataset from any Python function, on the conversion engine.

The user's function becomes one more converter kind (``write``): :class:`WriteConverter` is the
main-process half (its input sequence is ``inputs``, its record layout is given or inferred from the
first record), :class:`WriteDecoder` the worker half (calls ``fn`` on one input and checks every
record against the layout). Everything else — worker processes, executors, Dask, parts, resume,
provenance, append, object stores — is :func:`shardkit.converters.partrun.run_conversion`, exactly
as for ``convert``. Choices and their reasons: docs/design.md §5 (user guide: docs/write.md).
"""

from __future__ import annotations

import functools
import glob
import importlib
import itertools
import logging
import os
import pickle
import re
import stat
import sys
import traceback
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from shardkit.converters.base import RECORD_BYTES_PER_CALL, Converter, Decoded, Decoder, Record, ScanResult
from shardkit.converters.decoding import default_workers
from shardkit.converters.layout import Mismatch, RecordLayout, as_array, spec_of
from shardkit.converters.main_guard import refuse_inside_worker_start, workers_rerun_main
from shardkit.converters.options import OptionNaming
from shardkit.converters.partrun import _label, run_conversion
from shardkit.converters.pipeline import ConvertSummary, ProgressFn
from shardkit.converters.runoptions import ConversionOptions
from shardkit.declare import option_name
from shardkit.errors import ConfigError, ConversionError, InputFileError, SchemaError, ShardkitError
from shardkit.formats import FieldSpec
from shardkit.formats.paths import check_name
from shardkit.formats.provenance import BASE_COLUMNS, PROVENANCE_FIELD, TABLE_ARRAYS, ProvenanceSpec
from shardkit.formats.spec import DEFAULT_SHARD_BYTES
from shardkit.formats.versions import DEFAULT_KEEP_VERSIONS

__all__ = ["Layout", "WriteConverter", "WriteDecoder", "input_name", "inputs_from", "resolve_function", "write"]

logger = logging.getLogger(__name__)

#: Longest input name kept (in provenance, skip reasons and errors): the ``str`` of an input, cut here.
MAX_INPUT_NAME = 512
#: Longest line of an inputs file (``shardkit write --inputs FILE``).
MAX_INPUT_LINE = 1 << 16
#: ``module.sub:function.attr``
_REFERENCE = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$")
_GLOB_CHARS = "*?["


def input_name(item: Any) -> str:
    """How an input is named in provenance, skip reasons and errors: its ``str`` (a path as given),
    cut to :data:`MAX_INPUT_NAME` characters."""
    try:
        text = os.fspath(item) if isinstance(item, os.PathLike) else str(item)
    except Exception:  # a user object whose __str__ fails still gets a name
        text = f"<{type(item).__name__} object>"
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    return text if len(text) <= MAX_INPUT_NAME else text[: MAX_INPUT_NAME - 3] + "..."


def function_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a function (what configs, metadata and messages call it); a
    ``functools.partial`` is named after the function it wraps."""
    if isinstance(fn, functools.partial):
        return f"partial({function_name(fn.func)})"
    return f"{getattr(fn, '__module__', None) or '?'}:{getattr(fn, '__qualname__', None) or type(fn).__name__}"


def function_state(fn: Callable[..., Any]) -> str | None:
    """crc32 of what a ``functools.partial`` binds (its arguments, pickled), so that a resume with other
    arguments is refused; ``None`` for a plain function."""
    if not isinstance(fn, functools.partial):
        return None
    try:
        bound = pickle.dumps((function_state(fn.func), fn.args, sorted(fn.keywords.items())), protocol=5)
    except Exception:
        bound = repr((fn.args, fn.keywords)).encode("utf-8", "surrogateescape")
    return f"{zlib.crc32(bound):08x}"


def resolve_function(reference: str, *, what: str = "fn") -> Callable[..., Any]:
    """The function named ``module:function`` (``pkg.mod:Class.method`` too), imported here.

    ConfigError saying which part is wrong: not of that form, a module that is not found or fails to
    import (its error, no traceback), a missing attribute, something that is not callable.
    """
    match = _REFERENCE.match(reference.strip())
    if match is None:
        raise ConfigError(f"{what} {reference!r}: expected module:function (e.g. mypackage.prepare:make_record)")
    module_name, qualname = match.groups()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(f"{what} {reference!r}: no module named {exc.name!r} (looked in the current directory "
                              "and the Python path)") from None
        raise ConfigError(f"{what} {reference!r}: importing module {module_name!r} failed: {exc}") from None
    except SyntaxError as exc:
        raise ConfigError(f"{what} {reference!r}: module {module_name!r} does not parse: {exc.filename}:{exc.lineno}: "
                          f"{exc.msg}") from None
    except Exception as exc:
        raise ConfigError(f"{what} {reference!r}: importing module {module_name!r} failed: {type(exc).__name__}: "
                          f"{exc}{_where(exc)}") from None
    target: Any = module
    for part in qualname.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"{what} {reference!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
                              f"has no {qualname!r}") from None
    if not callable(target):
        raise ConfigError(f"{what} {reference!r}: {qualname!r} is a {type(target).__name__}, not a function")
    return target  # type: ignore[no-any-return]


def _where(exc: BaseException) -> str:
    """`` (at file:line)`` of the innermost frame of ``exc``'s traceback, or ``""``."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def inputs_from(spec: str | os.PathLike[str]) -> list[str]:
    """The inputs named by ``spec``: a file with one input per line (blank lines ignored), or a glob
    pattern (``images/**/*.png``, matches sorted). ConfigError when it names nothing or the file is not
    a regular file or has a line longer than :data:`MAX_INPUT_LINE` characters."""
    text = os.fspath(spec)
    if any(c in text for c in _GLOB_CHARS) and not os.path.exists(text):
        found = sorted(glob.glob(text, recursive=True))
        if not found:
            raise ConfigError(f"--inputs {text}: the pattern matches no file")
        return found
    try:
        st = os.stat(text)
    except OSError as exc:
        raise ConfigError(f"--inputs {text}: expected a file of inputs (one a line) or a glob pattern, found nothing "
                          f"there ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"--inputs {text}: expected a regular file of inputs (one a line), found "
                          f"{'a directory' if stat.S_ISDIR(st.st_mode) else 'a special file'}")
    found = []
    with open(text, encoding="utf-8", errors="surrogateescape", newline="") as fh:
        for number, line in enumerate(iter(lambda: fh.readline(MAX_INPUT_LINE + 2), ""), 1):
            line = line.rstrip("\r\n")
            if len(line) > MAX_INPUT_LINE:
                raise ConfigError(f"--inputs {text}: line {number} is longer than {MAX_INPUT_LINE} characters; "
                                  "expected one input per line")
            if line.strip():
                found.append(line)
    if not found:
        raise ConfigError(f"--inputs {text}: the file lists no input")
    return found


# ---------------------------------------------------------------------- the record layout
@dataclass(frozen=True)
class Layout:
    """Which key of ``fn``'s records is the payload (its spec ``record``) and which are small ``fields``;
    ``exact``: a record must have no other key (the layout was inferred), else other keys are dropped."""

    payload: str
    record: FieldSpec
    fields: Mapping[str, FieldSpec]
    exact: bool

    def specs(self) -> dict[str, FieldSpec]:
        return {self.payload: self.record, **self.fields}

    def describe(self) -> str:
        return ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in self.specs().items())


def _given_spec(value: Any, key: str, what: str) -> FieldSpec:
    """A spec given by the user: a FieldSpec, ``(shape, dtype)`` or a dtype (a scalar)."""
    try:
        if isinstance(value, FieldSpec):
            return value
        if isinstance(value, tuple) and len(value) == 2:
            return FieldSpec(tuple(value[0]), str(np.dtype(value[1])))
        return FieldSpec((), str(np.dtype(value)))
    except (TypeError, ValueError, SchemaError) as exc:
        raise ConfigError(f"{what} {key!r}: expected a FieldSpec, (shape, dtype) or a dtype, found {value!r} ({exc})") from None


def _check_key(key: Any, what: str) -> str:
    if not isinstance(key, str):
        raise ConfigError(f"{what}: record keys must be strings, found {key!r}")
    reserved = {PROVENANCE_FIELD, "key", *TABLE_ARRAYS}
    if key in reserved:
        raise ConfigError(f"{what}: the record key {key!r} is reserved by the dataset format ({sorted(reserved)}); rename it")
    try:
        check_name(key, "record key", what)
    except ShardkitError as exc:
        raise ConfigError(str(exc)) from None
    return key


def make_layout(first: Mapping[str, Any] | None, record: str | Mapping[str, Any] | None,
                fields: Sequence[str] | Mapping[str, Any] | None, where: str, naming: OptionNaming = "python") -> Layout:
    """The layout from what the user gave (``record``, ``fields``) completed by the ``first`` record
    (``None`` when both are given in full). The payload, when not named, is the key with the most bytes
    (the first such key on a tie); fields, when not named, are every other key."""
    rec_label, fields_label = option_name("record", naming), option_name("fields", naming)
    if first is not None and not isinstance(first, Mapping):
        raise ConversionError(f"{where}: fn gave a {type(first).__name__}; expected a dict of arrays and numbers "
                              "(one record), or an iterable of them")
    got = dict(first or {})
    for k in got:
        _check_key(k, where)

    def spec_from_first(key: str, what: str) -> FieldSpec:
        if key not in got:
            raise ConfigError(f"{what} {key!r}: the first record ({where}) has no such key; it has {sorted(got)}")
        try:
            return spec_of(got[key], key)
        except Mismatch as exc:
            raise ConversionError(f"{where}: {exc}") from None

    if isinstance(record, Mapping):
        if len(record) != 1:
            raise ConfigError(f"{rec_label}: expected one payload key (a name, or {{name: spec}}), found {list(record)}")
        ((payload, given),) = record.items()
        payload = _check_key(payload, rec_label)
        record_spec = _given_spec(given, payload, rec_label)
    elif isinstance(record, str):
        payload = _check_key(record, rec_label)
        record_spec = spec_from_first(payload, rec_label)
    elif record is None:
        if not got:
            raise ConversionError(f"{where}: fn gave an empty record; expected at least one array")
        sizes: dict[str, int] = {}
        for k, v in got.items():
            try:
                sizes[k] = as_array(v, k).nbytes
            except Mismatch as exc:
                raise ConversionError(f"{where}: {exc}") from None
        payload = max(sizes, key=lambda k: sizes[k])  # max keeps the first of equal ones
        record_spec = spec_from_first(payload, rec_label)
    else:
        raise ConfigError(f"{rec_label}: expected the payload key (a str) or {{name: spec}}, found {record!r}")
    if isinstance(fields, Mapping):
        field_specs = {_check_key(k, fields_label): _given_spec(v, k, fields_label) for k, v in fields.items()}
    elif fields is None:
        field_specs = {k: spec_from_first(k, fields_label) for k in got if k != payload}
    elif isinstance(fields, (str, bytes)) or not isinstance(fields, Iterable):
        raise ConfigError(f"{fields_label}: expected a list of keys or {{name: spec}}, found {fields!r}")
    else:
        field_specs = {_check_key(k, fields_label): spec_from_first(k, fields_label) for k in fields}
    if payload in field_specs:
        raise ConfigError(f"{fields_label}: {payload!r} is the payload ({rec_label}); a key is one or the other")
    return Layout(payload, record_spec, field_specs, exact=fields is None)


# ---------------------------------------------------------------------- the worker half
class WriteDecoder(Decoder):
    """Call ``fn`` on one input and check its records against the layout (a record that does not fit
    skips the input with reason ``mismatch: ...``, or stops a ``strict`` run). An exception from ``fn``
    stops the run, naming the input; ``fn`` skips an input on purpose by raising
    :class:`~shardkit.errors.InputFileError`.

    An input whose records exceed :data:`RECORD_BYTES_PER_CALL` is continued by later calls: the live
    generator is kept for the next call in this process, or ``fn`` runs again and its first records are
    passed over (``fn`` gives the same records for the same input, which determinism needs anyway).
    """

    def __init__(self, fn: Callable[..., Any], layout: Layout) -> None:
        super().__init__(layout.payload, layout.record)
        self.fn = fn
        self.layout = layout
        self.name = function_name(fn)
        #: Whether the last input ``fn`` gave something for returned one record (a dict) rather than an iterable.
        self.gave_one: bool | None = None
        self._enforced = RecordLayout(layout.specs(), layout.exact,
                                      "; name the keys to keep with fields= / --fields to drop others")
        self._live: tuple[bytes, int, Iterator[Any]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_live": None}  # a generator is not sent anywhere

    def item_path(self, item: Any) -> str:
        return input_name(item)

    def _failed(self, exc: Exception, where: str) -> ConversionError:
        return ConversionError(f"fn {self.name} raised {type(exc).__name__}: {exc}{_where(exc)}; finished shards are "
                               "kept: fix it and re-run the same command to resume")

    def _records(self, item: Any, where: str) -> Iterator[Any]:
        """``fn(item)``'s records, exceptions from ``fn`` turned into ConversionError (InputFileError: a skip)."""
        try:
            got = self.fn(item)
            if got is None:
                return
            self.gave_one = isinstance(got, Mapping)
            if isinstance(got, Mapping):
                yield got
                return
            if not isinstance(got, Iterable) or isinstance(got, (str, bytes, np.ndarray)):
                raise InputFileError(where, f"mismatch: fn gave a {type(got).__name__}; expected a dict of arrays and "
                                            "numbers (one record), or an iterable of them")
            records = iter(got)
            while True:
                try:
                    rec = next(records)
                except StopIteration:
                    return
                yield rec
        except (InputFileError, ConversionError):
            raise
        except Exception as exc:
            raise self._failed(exc, where) from None

    @staticmethod
    def _key(item: Any) -> bytes | None:
        try:
            return pickle.dumps(item, protocol=5)
        except Exception:
            return None

    def _from(self, item: Any, start: int, where: str) -> Iterator[Any]:
        live, self._live = self._live, None
        if start and live is not None and live[1] == start and live[0] == self._key(item):
            return live[2]
        return itertools.islice(self._records(item, where), start, None)

    def _check(self, rec: Any, where: str, number: int) -> Record:
        if not isinstance(rec, Mapping):
            raise InputFileError(where, f"mismatch: record {number} is a {type(rec).__name__}; expected a dict")
        return self._enforced.check(rec, where, f"record {number}")

    def decode(self, item: Any, start: int = 0) -> Decoded:
        where = self.item_path(item)
        per_record = sum(s.nbytes for s in self.layout.specs().values())
        records: Iterator[Any] = self._from(item, start, where)
        out: list[Record] = []
        for rec in records:
            out.append(self._check(rec, where, start + len(out)))
            if len(out) * per_record >= RECORD_BYTES_PER_CALL:
                break
        else:
            return Decoded(out, start)
        try:
            following = next(records)
        except StopIteration:
            return Decoded(out, start)
        key = self._key(item)
        if key is not None:
            self._live = (key, start + len(out), itertools.chain([following], records))
        return Decoded(out, start, more=True)


# ---------------------------------------------------------------------- the main-process half
class WriteConverter(Converter):
    """The ``write`` kind: ``fn`` over ``inputs`` (see the module docstring). Not in the registry: there
    is no corpus to detect; :func:`write` builds it."""

    name: ClassVar[str] = "write"
    progress_unit: ClassVar[str] = "input"
    chunk_size: ClassVar[int] = 1
    nothing_hint: ClassVar[str] = "does fn give records for these inputs?"

    def __init__(self, fn: Callable[..., Any], inputs: Sequence[Any], layout: Layout, *,
                 naming: OptionNaming = "python", one_each: bool = False) -> None:
        # Not Converter.__init__: there is no corpus path and no kind option. Workers check that they
        # see ``src``; the inputs are fn's business, so it is the root directory.
        self.src = Path(os.sep)
        self.naming = naming
        self.values = {}
        self.fn = fn
        self.inputs = inputs
        self.layout = layout
        self.payload = layout.payload  # type: ignore[misc]  # the user's key, per instance
        self.one_each = one_each

    @property
    def records_follow_inputs(self) -> bool:
        """``fn`` returned one record (a dict) for the first input it gave something for."""
        return self.one_each

    @classmethod
    def detect(cls, src: Path) -> bool:
        return False

    def describe(self) -> str:
        return f"write {function_name(self.fn)}"

    def scan(self) -> ScanResult:
        return ScanResult(items=self.inputs)

    def record_spec(self) -> FieldSpec:
        return self.layout.record

    def fields(self) -> dict[str, FieldSpec]:
        return dict(self.layout.fields)

    def labels(self) -> dict[str, list[str]]:
        return {}

    def make_decoder(self) -> Decoder:
        return WriteDecoder(self.fn, self.layout)

    def source(self) -> dict[str, Any]:
        name = function_name(self.fn)
        return {"path": name, "kind": self.name, "fn": name}

    def config(self) -> dict[str, Any]:
        return {"kind": self.name, "fn": function_name(self.fn), "bound": function_state(self.fn),
                "payload": self.layout.payload, "exact": self.layout.exact}

    def input_name(self, item: Any) -> str:
        return input_name(item)

    def provenance_spec(self, scan: ScanResult) -> ProvenanceSpec:
        # Inputs are not paths under a corpus root: names are stored whole, with an empty root.
        return ProvenanceSpec(columns=BASE_COLUMNS, root="", inputs=self.input_names(scan.items), summarize=None)

    def inputs_fingerprint(self, scan: ScanResult) -> str:
        """crc32 of every input's whole ``str`` (not only its cut name): a resume over other inputs is refused."""
        crc = 0
        for item in scan.items:
            try:
                text = os.fspath(item) if isinstance(item, os.PathLike) else str(item)
            except Exception:
                text = input_name(item)
            if isinstance(text, bytes):
                text = text.decode("utf-8", "surrogateescape")
            crc = zlib.crc32(text.encode("utf-8", "surrogateescape") + b"\n", crc)
        return f"{len(scan.items)}:{crc:08x}"


def _first_record(fn: Callable[..., Any], inputs: Sequence[Any], decoder: WriteDecoder) -> tuple[Any, str]:
    """The first record ``fn`` gives, going through ``inputs`` in order (inputs ``fn`` skips on purpose
    or that give nothing are passed over), and the name of its input."""
    for item in inputs:
        where = input_name(item)
        try:
            for rec in decoder._records(item, where):
                return rec, where
        except InputFileError:
            continue
    raise ConversionError(f"fn {function_name(fn)} gave no record for any of the {len(inputs)} inputs; nothing was written")


def _sendable(fn: Callable[..., Any]) -> str | None:
    """Why worker processes cannot get ``fn`` (by reference, as pickle sends functions), or ``None``."""
    if isinstance(fn, functools.partial):
        why = _sendable(fn.func)
        if why is None:
            try:
                pickle.dumps((fn.args, fn.keywords))
            except Exception as exc:
                return f"{function_name(fn)}: its arguments cannot be pickled ({type(exc).__name__}: {exc})"
        return why
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        return f"{function_name(fn)} is a lambda or a function defined inside another one"
    if module == "__main__" and not workers_rerun_main():
        return f"{function_name(fn)} is defined in an interactive session or a script workers do not import"
    try:
        again = pickle.loads(pickle.dumps(fn))
    except Exception as exc:
        return f"{function_name(fn)} cannot be pickled ({type(exc).__name__}: {exc})"
    if again is not fn and getattr(again, "__qualname__", None) != qualname:
        return f"{function_name(fn)} does not import back as itself"
    return None


def write(
    fn: Callable[[Any], Any] | str,
    inputs: Iterable[Any],
    out: str | os.PathLike[str],
    *,
    record: str | Mapping[str, Any] | None = None,
    fields: Sequence[str] | Mapping[str, Any] | None = None,
    workers: int | str | None = None,
    strict: bool = False,
    overwrite: bool = False,
    compression: str | None = None,
    shard_bytes: int | str = DEFAULT_SHARD_BYTES,
    records_per_shard: int | str | None = None,
    progress: ProgressFn | bool | None = None,
    executor: Executor | None = None,
    scheduler: str | None = None,
    append: bool = False,
    part_size: int | str | None = None,
    keep_versions: int | str = DEFAULT_KEEP_VERSIONS,
    staging_dir: str | os.PathLike[str] | None = None,
    naming: OptionNaming = "python",
) -> ConvertSummary:
    """Write the records ``fn`` gives for each of ``inputs``, in input order, as a dataset at ``out``.

    Parameters
    ----------
    fn
        A function of one input returning one record (a dict of numpy arrays and numbers), an iterable
        (a generator) of records, or ``None`` (no record); or its name, ``"module:function"``. Worker
        processes import it: a lambda or nested function runs only in this process (``workers=1``; the
        default then falls back to it, logged). It must give the same records for the same input.
    inputs
        The inputs, any sequence (paths, strings, numbers, picklable objects); each record's provenance
        names its input by ``str`` (at most 512 characters).
    out
        Dataset directory or object-store URL; an interrupted run with the same arguments resumes.
    record, fields
        The payload key and the small per-record fields: names (their shape and dtype taken from the
        first record) or ``{name: FieldSpec | (shape, dtype) | dtype}``. Default: the key with the most
        bytes in the first record is the payload, every other key a field, and a record with another
        key set is a mismatch; with ``fields`` given, other keys are dropped.
    strict
        A record that does not fit the layout stops the run (ConversionError naming the input) instead of
        skipping its input with reason ``mismatch``.
    workers, overwrite, compression, shard_bytes, records_per_shard, progress, executor, scheduler, append, \
part_size, keep_versions, staging_dir, naming
        As for :func:`shardkit.convert`; the output is byte-identical whatever runs it.
    """
    refuse_inside_worker_start()
    fn = resolve_function(fn, what=option_name("fn", naming)) if isinstance(fn, str) else fn
    if not callable(fn):
        raise ConfigError(f"fn: expected a function or 'module:function', found {type(fn).__name__}")
    if isinstance(inputs, (str, bytes, os.PathLike)):
        raise ConfigError(f"{option_name('inputs', naming)}: expected a sequence of inputs, found the single "
                          f"{type(inputs).__name__} {inputs!r}; use shardkit.converters.write.inputs_from() for a "
                          "file of inputs or a glob")
    items: Sequence[Any] = inputs if isinstance(inputs, Sequence) else list(inputs)
    if len(items) == 0:
        raise ConfigError(f"{option_name('inputs', naming)}: no inputs; nothing was written")
    run = ConversionOptions.parse(
        source=naming, workers=workers, strict=strict, overwrite=overwrite, compression=compression,
        shard_bytes=shard_bytes, records_per_shard=records_per_shard, progress=progress, executor=executor,
        scheduler=scheduler, append=append, part_size=part_size, keep_versions=keep_versions, staging_dir=staging_dir,
    )
    n_workers, n_part = run.workers, run.part_size
    elsewhere = executor is not None or scheduler is not None or (n_part is not None and (n_workers or 2) > 1)
    why = _sendable(fn) if elsewhere or n_workers is None or n_workers > 1 else None
    if why is not None:
        if elsewhere or n_workers is not None:
            raise ConfigError(f"fn: {why}: worker processes cannot import it; define it at the top level of a module "
                              f"(module:function), or run it in this process with {_label('workers', naming)} 1")
        logger.warning("fn: %s: running it in this process (workers=1); define it at the top level of a module to "
                       "use %d worker processes", why, default_workers())
        n_workers = 1
    given_in_full = isinstance(record, Mapping) and isinstance(fields, Mapping)
    probe = WriteDecoder(fn, Layout("", FieldSpec((), "uint8"), {}, exact=False))
    first, where = (None, "") if given_in_full else _first_record(fn, items, probe)
    layout = make_layout(first, record, fields, where or "fn", naming)
    logger.info("write %s: payload %s; fields %s", function_name(fn), layout.payload, layout.describe())
    conv = WriteConverter(fn, items, layout, naming=naming, one_each=probe.gave_one is True)
    return run_conversion(conv, out, f"write {function_name(fn)}", naming=naming,
                          **{**run.run_keywords(), "workers": n_workers})


def cli_path() -> None:
    """Let ``shardkit write module:function`` import modules of the current directory (as ``python -m`` does)."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
