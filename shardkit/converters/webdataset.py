"""WebDataset tar shards: a ``.tar`` file, a directory of them, or a brace pattern (``shards-{000..099}.tar``),
local or in an object store (``s3://bucket/shards-{000..099}.tar``, ``s3://bucket/prefix/``).

Members are grouped into samples as WebDataset groups them: the key is the member name up to the first
dot of its last path component, consecutive members with one key form one sample, and the text after
that dot (lower case) names the member's role. The payload is the sample's image or audio member,
transformed like the image and audio folder kinds do; ``cls`` / ``class`` / ``label`` (or the member
``label`` names, ``txt`` for example) gives ``label``; ``npy`` members of a fixed shape and the number
values at the top level of a ``json`` member become fields (inferred from the first sample, then
enforced); every other member is dropped and counted in the summary. Provenance: shard name and key.

Tar headers are parsed here, not by :mod:`tarfile`, so that every size is checked against the file
before anything is read: a member claiming more bytes than the shard holds makes the shard
``truncated`` (an error naming it) before a byte of it is read; links, devices and absolute or ``..``
names are refused (their sample is skipped with the reason). Remote shards are listed once (size and
ETag of each) and read through :mod:`shardkit.stores` in ranges pinned to that ETag, with the same
bounds: a shard replaced during the conversion stops it, and the ETags are part of the resume
fingerprint. docs/design.md §13.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import stat
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from shardkit.converters import untrusted_json
from shardkit.converters.audio import AUDIO_OPTIONS
from shardkit.converters.audio_transforms import AUDIO_COLUMNS, AUDIO_EXTENSIONS, AudioTransform
from shardkit.converters.base import PROVENANCE, RECORD_BYTES_PER_CALL, Converter, Decoded, Decoder, Note, ScanResult, Skip
from shardkit.converters.images import IMAGE_COLUMNS, IMAGE_EXTENSIONS, IMAGE_OPTIONS, ImageTransform
from shardkit.converters.layout import RecordLayout, spec_of
from shardkit.converters.options import Option, choice, count, parse_options, text
from shardkit.errors import (
    ConfigError,
    ConversionError,
    DatasetNotFoundError,
    InputFileError,
    ObjectChangedError,
    StoreError,
)
from shardkit.formats import FieldSpec
from shardkit.formats.provenance import ENDS_ARRAY, NAMES_ARRAY, PROVENANCE_FIELD
from shardkit.stores.url import is_url, location_string

__all__ = [
    "LABEL_ROLES",
    "MAX_SHARDS",
    "ShardSource",
    "TarMember",
    "WebDatasetConverter",
    "WebDatasetDecoder",
    "expand_braces",
    "read_members",
    "sample_key",
]

logger = logging.getLogger(__name__)

_BLOCK = 512
#: Most shards a brace pattern may expand to.
MAX_SHARDS = 1 << 20
#: Largest GNU long name or pax extended header accepted (real ones are a few hundred bytes).
_MAX_META_BYTES = 1 << 20
#: Largest label member read (a class number or name).
_MAX_LABEL_BYTES = 256
#: Largest ``.json`` member parsed (metadata of one sample; real ones are a few hundred bytes).
_MAX_JSON_BYTES = 1 << 20
#: Most classes a numeric label may imply (``cls`` 10**9 would ask for a billion class names).
_MAX_CLASSES = 1 << 20
#: Bytes a remote shard is read ahead of a header (one request covers the headers of many small members).
_WINDOW = 1 << 20
#: Roles that hold a class, in the order the default label is looked for.
LABEL_ROLES = ("cls", "class", "label")
_IMAGE_ROLES = frozenset(e.lstrip(".") for e in IMAGE_EXTENSIONS)
_AUDIO_ROLES = frozenset(e.lstrip(".") for e in AUDIO_EXTENSIONS)
_FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_RESERVED_FIELDS = frozenset({"image", "audio", "key", "label", PROVENANCE_FIELD, NAMES_ARRAY, ENDS_ARRAY})
_MEDIA = ("image", "audio")

_OPTIONS = (
    Option("media", str, None, "Payload from the image or the audio members (default: "
           "what the first sample holds).", parse=choice(*_MEDIA), metavar="KIND"),
    Option("member", str, None, "The payload member's extension (jpg, seg.png, flac; default: the "
           "first image or audio member of the first sample).", parse=text, metavar="EXT"),
    Option("label", str, None, "The member holding the class, a number or a name (default: cls, class "
           "or label when present; txt for text labels).", parse=text, metavar="EXT"),
    Option("max_member_bytes", int, 256 << 20, "Largest tar member read; a sample with a larger one "
           "is skipped (too-large).", parse=count(1), metavar="N"),
    *IMAGE_OPTIONS,
    *AUDIO_OPTIONS,
)


# ---------------------------------------------------------------------- shard names
def expand_braces(pattern: str) -> list[str]:
    """Every name of a brace pattern, in order: ``{000..012}`` counts (zero-padded to the first bound's
    width), ``{a,b}`` lists; several groups multiply. ConfigError past :data:`MAX_SHARDS` names or for an
    unclosed brace (nothing is built before the count is known)."""
    parts: list[list[str]] = []
    pos = 0
    total = 1
    for m in re.finditer(r"\{([^{}]*)\}", pattern):
        parts.append([pattern[pos : m.start()]])
        body = m.group(1)
        rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
        if rng:
            lo, hi = int(rng.group(1)), int(rng.group(2))
            if hi < lo:
                raise ConfigError(f"{pattern}: the range {{{body}}} counts down")
            n = hi - lo + 1
            if total * n > MAX_SHARDS:
                raise ConfigError(f"{pattern}: expands to more than {MAX_SHARDS} shard names")
            width = len(rng.group(1))
            parts.append([str(i).zfill(width) for i in range(lo, hi + 1)])
        else:
            choices = body.split(",")
            n = len(choices)
            if total * n > MAX_SHARDS:
                raise ConfigError(f"{pattern}: expands to more than {MAX_SHARDS} shard names")
            parts.append(choices)
        total *= n
        pos = m.end()
    parts.append([pattern[pos:]])
    if "{" in pattern[pos:] or "}" in pattern[pos:] or any("{" in p[0] or "}" in p[0] for p in parts[:-1:2]):
        raise ConfigError(f"{pattern}: unbalanced braces (expected {{000..099}} or {{a,b}} groups)")
    names = [""]
    for options in parts:
        names = [n + o for n in names for o in options]
    return names


def _is_pattern(src: Path | str) -> bool:
    name = src.name if isinstance(src, Path) else src.rstrip("/").rsplit("/", 1)[-1]
    return "{" in name and "}" in name


@dataclass(frozen=True)
class ShardSource:
    """One shard to read: a local file (``store`` is ``None``, ``name`` its path) or an object of the
    store at the URL ``store`` (``key`` in it, ``size`` and ``etag`` as listed, ``name`` its URL).
    Small and picklable: workers open the store themselves (one per process, :func:`open_store`)."""

    name: str
    size: int = 0
    store: str | None = None
    key: str = ""
    etag: str | None = None

    def sample(self, key: str) -> str:
        """How messages name a sample: ``shard#key`` (a remote shard's URL and the key apart, since a URL's
        ``#...`` is a fragment, hidden from messages like any secret)."""
        return f"{self.name}#{key}" if self.store is None else f"{self.name} sample {key}"

    def open(self, window: int = 0) -> tuple[Any, int]:
        """``(file-like with seek/read, size)``; a remote shard is read in ranges of at least ``window``
        bytes, each pinned to the listed ETag (a shard replaced since it was listed is
        ObjectChangedError, never a mix of versions)."""
        if self.store is None:
            return _open_shard(Path(self.name))
        from shardkit.stores import open_store

        return _RemoteShard(open_store(self.store), self.key, self.size, self.etag, window), self.size


class _RemoteShard:
    """A read-only file over one object: ``read`` asks the store for a range of at least ``window`` bytes
    (scanning reads :data:`_WINDOW` ahead, so walking the headers of small members costs one request
    per window, not per member) and serves later reads inside it from memory."""

    def __init__(self, store: Any, key: str, size: int, etag: str | None, window: int) -> None:
        self.store, self.key, self.size, self.etag, self.window = store, key, size, etag, window
        self.pos = 0
        self._start, self._buf = 0, memoryview(b"")

    def seek(self, pos: int) -> int:
        self.pos = pos
        return pos

    def need(self, start: int, end: int) -> None:
        """Hold bytes ``[start, end)`` in memory (one request from ``start``, at least ``window`` long,
        unless they are held already)."""
        end = min(end, self.size)
        if end > start and not (self._start <= start and end <= self._start + len(self._buf)):
            ahead = min(max(end, start + self.window), self.size)
            self._start, self._buf = start, self.store.get_range(self.key, start, ahead, etag=self.etag)

    def read(self, n: int) -> bytes:
        end = min(self.pos + n, self.size)
        if end <= self.pos:
            return b""
        self.need(self.pos, end)
        out = bytes(self._buf[self.pos - self._start : end - self._start])
        self.pos = end
        return out

    def __enter__(self) -> _RemoteShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self._buf = memoryview(b"")

    def close(self) -> None:
        self._buf = memoryview(b"")


def _listing(root: str) -> tuple[Any, dict[str, Any]]:
    """The store at ``root`` and its objects directly under it (key -> ObjectMeta)."""
    from shardkit.stores import open_store

    store = open_store(root)
    return store, {m.key: m for m in store.list("") if "/" not in m.key}


def _remote_shards(url: str) -> tuple[str, list[ShardSource]]:
    """``(directory URL, shards)`` of an object-store source: one ``.tar`` object, a brace pattern in
    the last component (every name must be listed), or a prefix (the ``.tar`` objects directly in it,
    sorted). One listing of the directory gives every size and ETag; nothing is read yet."""
    from shardkit.stores.url import location_string

    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    head, _, last = path.rpartition("/")
    if parts.path.endswith("/") or not (last.endswith(".tar") or _is_pattern(last)):
        head, last = path, ""  # a prefix (or the bucket)
    root = urlunsplit((parts.scheme, parts.netloc, head, parts.query, ""))
    shown = location_string(root)
    store, listed = _listing(root)
    if last and _is_pattern(last):
        names = expand_braces(last)
        missing = [n for n in names if n not in listed]
        if missing:
            raise ConversionError(f"{location_string(url)}: {len(missing)} of {len(names)} shards do not exist, the "
                                  f"first {store.describe(missing[0])}")
    elif last:
        if last not in listed:
            raise DatasetNotFoundError(f"{location_string(url)}: corpus not found (no such object)")
        names = [last]
    else:
        names = sorted(k for k in listed if k.endswith(".tar") and not k.startswith("."))
        if not names:
            raise ConversionError(f"{shown}: no .tar shards under the prefix")
    return root, [ShardSource(store.describe(n), listed[n].size, root, n, listed[n].etag) for n in names]


def _shard_paths(src: Path) -> list[Path]:
    """The shards of ``src``: itself (a ``.tar``), the ``.tar`` files directly in it (sorted), or those of
    a brace pattern in its last component (each must exist)."""
    if _is_pattern(src):
        found = [src.parent / name for name in expand_braces(src.name)]
        missing = [p for p in found if not p.exists()]
        if missing:
            raise ConversionError(f"{src}: {len(missing)} of {len(found)} shards do not exist, the first {missing[0]}")
        return found
    if src.is_file():
        return [src]
    try:
        names = sorted(e.name for e in os.scandir(src) if e.name.endswith(".tar") and not e.name.startswith("."))
    except OSError as exc:
        raise ConversionError(f"{src}: cannot list the directory: {exc.strerror or exc}") from None
    if not names:
        raise ConversionError(f"{src}: no .tar shards in the directory")
    return [src / n for n in names]


# ---------------------------------------------------------------------- tar headers
@dataclass(frozen=True)
class TarMember:
    """One regular member of a shard: its name, where its data starts and its size; ``refused`` says why
    it cannot be used (a link, a device, an unsafe name, too large), ``None`` when it can."""

    name: str
    offset: int
    size: int
    refused: str | None = None


def _field(block: bytes, start: int, end: int) -> bytes:
    return block[start:end].split(b"\0", 1)[0]


def _number(raw: bytes) -> int | None:
    """A tar numeric field: octal text, or base-256 (first byte 0x80/0xff); ``None`` when neither."""
    if raw and raw[0] & 0x80:
        value = int.from_bytes(raw[1:], "big")
        return -((1 << (8 * len(raw) - 8)) - value) if raw[0] == 0xFF else value
    digits = raw.split(b"\0", 1)[0].strip(b" ")
    if not digits:
        return 0
    try:
        return int(digits, 8)
    except ValueError:
        return None


def _checksum_ok(block: bytes) -> bool:
    stored = _number(block[148:156])
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    signed = unsigned - sum(256 for b in (*block[:148], *block[156:]) if b >= 128)
    return stored in (unsigned, signed)


def _pax(data: bytes, shard: str) -> dict[str, str]:
    """The records of a pax extended header (``"LEN key=value\\n"``)."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        length = _number_dec(data[pos:space]) if space > pos else None
        if length is None or length <= 0 or pos + length > len(data):
            raise ConversionError(f"{shard}: corrupt pax header near byte {pos} (expected 'LENGTH key=value')")
        key, eq, value = data[space + 1 : pos + length - 1].partition(b"=")
        if eq:
            out[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def _number_dec(raw: bytes) -> int | None:
    return int(raw) if raw.isdigit() and len(raw) < 12 else None


def _unsafe_name(name: str) -> str | None:
    if name.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", name):
        return "an absolute name"
    if ".." in re.split(r"[\\/]", name):
        return "a '..' component"
    if "\0" in name:
        return "a NUL in the name"
    return None


_REFUSED_TYPES = {b"1": "a hard link", b"2": "a symbolic link", b"3": "a character device", b"4": "a block device",
                  b"6": "a FIFO", b"S": "a GNU sparse file"}


def read_members(fh: Any, file_size: int, shard: str, max_member: int) -> Iterator[TarMember]:
    """Every member of the tar open as ``fh`` (``file_size`` bytes) that a sample may hold, in order.

    Only headers are read. A size beyond the file or an end without the end-of-archive block is
    ``ConversionError("<shard>: truncated: ...")``; a bad header checksum ``corrupt``. Directories and
    pax global headers are passed over; links, devices, sparse files, unsafe names and members over
    ``max_member`` bytes come back with :attr:`TarMember.refused` set."""
    pos = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    last = "the first header"
    while True:
        fh.seek(pos)
        block = fh.read(_BLOCK)
        if len(block) < _BLOCK:
            raise ConversionError(f"{shard}: truncated: the file ends at byte {pos + len(block)}, after {last}, "
                                  "without the end-of-archive block")
        if block == b"\0" * _BLOCK:
            return
        if not _checksum_ok(block):
            raise ConversionError(f"{shard}: corrupt: bad tar header checksum at byte {pos} (after {last}); not a tar "
                                  "file, or damaged")
        kind = block[156:157]
        size = _number(block[124:136])
        if size is None or size < 0:
            raise ConversionError(f"{shard}: corrupt: tar header at byte {pos} has no valid size")
        name = _field(block, 0, 100).decode("utf-8", "surrogateescape")
        if block[257:263] == b"ustar\x00":
            prefix = _field(block, 345, 500).decode("utf-8", "surrogateescape")
            if prefix:
                name = f"{prefix}/{name}"
        if long_name is not None:
            name, long_name = long_name, None
        if "path" in pax:
            name = pax["path"]
        if "size" in pax:
            claimed = _number_dec(pax["size"].encode())
            if claimed is None:
                raise ConversionError(f"{shard}: corrupt: pax size {pax['size']!r:.40} of {name!r} is not a number")
            size = claimed
        data = pos + _BLOCK
        end = data + size
        if end > file_size:
            raise ConversionError(
                f"{shard}: truncated: member {name!r} claims {size} bytes at byte {data}, but the file ends at byte "
                f"{file_size}")
        if kind in (b"L", b"x", b"g", b"K"):
            if size > _MAX_META_BYTES:
                raise ConversionError(f"{shard}: corrupt: a tar extension header of {size} bytes at byte {pos} "
                                      f"(at most {_MAX_META_BYTES} accepted)")
            fh.seek(data)
            meta = fh.read(size)
            if kind == b"L":
                long_name = meta.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            elif kind == b"x":
                pax = _pax(meta, shard)
            pos = data + -(-size // _BLOCK) * _BLOCK
            continue
        pax = {}
        last = f"member {name!r}"
        pos = data + -(-size // _BLOCK) * _BLOCK
        if kind == b"5":
            continue
        unsafe = _unsafe_name(name)
        if kind in _REFUSED_TYPES:
            yield TarMember(name, data, 0, f"unsafe: member {name!r} is {_REFUSED_TYPES[kind]}")
        elif kind not in (b"0", b"\0", b"7"):
            yield TarMember(name, data, 0, f"unsupported: member {name!r} has tar type {kind!r}")
        elif unsafe is not None:
            yield TarMember(name, data, 0, f"unsafe: member {name!r} has {unsafe}")
        elif size > max_member:
            yield TarMember(name, data, size, f"too-large: member {name!r} holds {size} bytes, more than "
                            f"max_member_bytes {max_member}")
        else:
            yield TarMember(name, data, size)


def sample_key(name: str) -> tuple[str, str] | None:
    """WebDataset's split of a member name into ``(key, role)``: the key runs to the first dot of the
    last path component, the role is the rest (lower case); ``None`` when that component has no dot."""
    head, sep, base = name.rpartition("/")
    stem, dot, role = base.partition(".")
    if not dot or not stem:
        return None
    return head + sep + stem, role.lower()


def _open_shard(path: Path) -> tuple[Any, int]:
    """``(open file, size)`` of a regular file; ConversionError naming it otherwise."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ConversionError(f"{path}: not a regular file (a directory, FIFO or device)")
        return open(path, "rb"), st.st_size
    except OSError as exc:
        raise ConversionError(f"{path}: cannot open the shard: {exc.strerror or exc}") from None


# ---------------------------------------------------------------------- samples
#: One sample: shard number, key, its label id (-1: none) and members ``(role, offset, size)``.
Sample = tuple[int, str, int, tuple[tuple[str, int, int], ...]]


@dataclass(frozen=True)
class _Plan:
    """What every sample must give: the payload member's role, the label role, the fields of ``npy`` members
    (role -> (name, spec)) and of the ``json`` member (key -> (name, spec))."""

    media: str
    member: str
    label: str | None
    arrays: dict[str, tuple[str, FieldSpec]]
    numbers: dict[str, tuple[str, FieldSpec]]


def _read_at(fh: Any, offset: int, size: int) -> bytes:
    fh.seek(offset)
    return bytes(fh.read(size))


def _npy_spec(data: bytes, where: str) -> tuple[np.ndarray, FieldSpec]:
    """The array of an ``.npy`` member and its spec; InputFileError when it is not one. Never unpickled,
    and the header's shape must account for exactly the bytes that follow it before anything is made
    (``np.load`` of a file object allocates whatever the header claims)."""
    fh = io.BytesIO(data)
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(fh)
        else:
            raise ValueError(f"format version {version[0]}.{version[1]} is not 1.0 or 2.0")
    except Exception as exc:  # numpy raises ValueError, SyntaxError, ... for a bad header
        raise InputFileError(where, f"corrupt: not a .npy array ({type(exc).__name__}: {exc})") from None
    if dtype.hasobject:
        raise InputFileError(where, "unsupported: a .npy array of Python objects (never unpickled)")
    count = math.prod(shape)
    need, have = count * dtype.itemsize, len(data) - fh.tell()
    if need != have:
        raise InputFileError(where, f"corrupt: the .npy header claims {list(shape)} {dtype} ({need} bytes), the member "
                             f"holds {have} bytes of data")
    try:
        spec = FieldSpec(shape, dtype.str.lstrip("<>=|"))
    except Exception as exc:  # an empty shape, a non-numeric dtype
        raise InputFileError(where, f"unsupported: {exc}") from None
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=fh.tell())
    arr = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    return np.ascontiguousarray(arr), spec


def _json_numbers(fh: Any, offset: int, size: int, where: str) -> dict[str, int | float | bool]:
    """The finite number values at the top level of the ``.json`` member at ``offset`` (its size checked
    against :data:`_MAX_JSON_BYTES` before it is read)."""
    if size > _MAX_JSON_BYTES:
        raise InputFileError(where, f"too-large: a .json member of {size} bytes, at most {_MAX_JSON_BYTES} are parsed")
    data = _read_at(fh, offset, size)
    try:
        doc, _ = untrusted_json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise InputFileError(where, f"corrupt: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(v, (bool, int, float)) and not (isinstance(v, float) and not math.isfinite(v))}


class WebDatasetDecoder(Decoder):
    """Decode one sample: read its members from the shard, transform the payload, check the fields."""

    def __init__(self, record: FieldSpec, shards: list[ShardSource], plan: _Plan, image: ImageTransform | None,
                 audio: AudioTransform | None) -> None:
        super().__init__(plan.media, record)
        self.shards, self.plan, self.image, self.audio = shards, plan, image, audio
        #: The fields of the first sample, enforced on every later one (other members are not fields).
        self.enforced = RecordLayout(dict((*plan.arrays.values(), *plan.numbers.values())), exact=False)
        self.per_call = max(1, RECORD_BYTES_PER_CALL // record.nbytes)
        #: The last remote shard read (shard number, reader): a task's samples are consecutive in their
        #: shard, so one read-ahead window serves several of them.
        self._remote: tuple[int, _RemoteShard] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_remote": None}

    def item_path(self, item: Sample) -> str:
        return self.shards[item[0]].sample(item[1])

    def _reader(self, shard: int) -> _RemoteShard:
        """A remote shard's reader, kept from the previous sample when it is the same shard."""
        if self._remote is None or self._remote[0] != shard:
            self._remote = None
            self._remote = (shard, self.shards[shard].open(_WINDOW)[0])
        return self._remote[1]

    def decode(self, item: Sample, start: int = 0) -> Decoded:
        shard, _key, label, members = item
        where = self.item_path(item)
        plan = self.plan
        roles = {role: (offset, size) for role, offset, size in members}
        if plan.member not in roles:
            raise InputFileError(where, f"missing: no .{plan.member} member")
        dropped = Counter(role for role in roles if role not in (plan.member, plan.label, "json", *plan.arrays))
        source = self.shards[shard]
        try:
            fh = open(source.name, "rb") if source.store is None else self._reader(shard)
        except OSError as exc:
            raise InputFileError(where, f"unreadable: {exc.strerror or exc}") from None
        try:
            if source.store is not None:  # the members used, from the first in the shard: one request
                used = [roles[r] for r in (plan.member, *plan.arrays, *(("json",) if plan.numbers else ())) if r in roles]
                self._reader(shard).need(min(o for o, _ in used), max(o + n for o, n in used))
            return self._decode(fh, where, roles, dropped, label, start)
        except StoreError as exc:
            changed = isinstance(exc, ObjectChangedError)
            raise ConversionError(
                f"{source.name}: " + ("the shard changed during the conversion (its ETag is no longer the one listed "
                                      "when it started); re-run to convert the shards as they are now" if changed
                                      else f"cannot read the shard: {exc}")) from None
        finally:
            if source.store is None:
                fh.close()

    def _decode(self, fh: Any, where: str, roles: dict[str, tuple[int, int]], dropped: Counter[str], label: int,
                start: int) -> Decoded:
        plan = self.plan
        fields: dict[str, Any] = {}
        payload = _read_at(fh, *roles[plan.member])
        found: dict[str, Any] = {}
        for role, (name, _spec) in plan.arrays.items():
            if role not in roles:
                raise InputFileError(where, f"mismatch: no .{role} member (the first sample has one)")
            found[name] = _npy_spec(_read_at(fh, *roles[role]), f"{where}.{role}")[0]
        if plan.numbers:
            if "json" not in roles:
                raise InputFileError(where, "mismatch: no .json member (the first sample has one)")
            values = _json_numbers(fh, *roles["json"], f"{where}.json")
            found.update({name: values[key] for key, (name, _spec) in plan.numbers.items() if key in values})
        fields.update(self.enforced.check(found, where, "the sample"))
        notes = tuple(Note(f"dropped .{role}", "no image, audio, label, .npy or .json number member; not kept")
                      for role in sorted(dropped))
        base = {"label": np.int64(label), **fields}
        if plan.media == "image":
            assert self.image is not None
            loaded = self.image.load(Path(f"{where}.{plan.member}"), payload)
            return Decoded([{"image": loaded.array, **base, PROVENANCE: loaded.provenance()}], notes=notes)
        assert self.audio is not None
        clips = self.audio.read(Path(f"{where}.{plan.member}"), start, self.per_call, data=payload)
        source = clips.provenance()
        return Decoded([{"audio": clip, **base, PROVENANCE: source} for clip in clips.records], start, clips.more,
                       notes=notes if start == 0 else ())


class WebDatasetConverter(Converter):
    """Convert WebDataset tar shards (see the module docstring)."""

    name = "webdataset"
    options = _OPTIONS
    detect_priority = 10
    chunk_size = 8
    progress_unit = "sample"

    def __init__(self, src: str | Path, **options: Any) -> None:
        #: The object-store URL of the shards as given (``None``: local shards).
        self.url: str | None = None
        #: The shards' directory URL (remote shards; :meth:`source_root`).
        self.url_root = ""
        if isinstance(src, str) and is_url(src):
            # No local path: options are parsed as Converter.__init__ does, then the store is listed.
            self.url, self.pattern = src, None
            self.src = Path(os.sep)
            self.naming = options.pop("naming", "python")
            self.values = parse_options(self.name, self.options, options, self.naming)
            _root, self.sources = _remote_shards(src)
            self.url_root = self.sources[0].name[: -len(self.sources[0].key)].rstrip("/")
            self.shards = [Path(s.key) for s in self.sources]
        else:
            src = Path(src)
            #: The brace pattern naming the shards, or ``None``; :attr:`src` is then its (existing) directory.
            self.pattern = src.name if _is_pattern(src) else None
            super().__init__(src.parent if self.pattern else src, **options)
            self.shards = _shard_paths(self.src / self.pattern if self.pattern else self.src)
            #: Every shard as read (a local file or an object).
            self.sources = [ShardSource(str(p)) for p in self.shards]
        v = self.values
        self.image = ImageTransform.from_options(v, self.label)
        if round(v["duration"] * v["sample_rate"]) < 1:
            raise ConfigError(f"{self.label('duration')} {v['duration']} at {self.label('sample_rate')} "
                              f"{v['sample_rate']} is less than one sample")
        self.audio = AudioTransform(v["sample_rate"], v["duration"], v["channels"], v["window"], v["dtype"])
        self._scanned: ScanResult | None = None
        self._plan: _Plan | None = None
        self._classes: list[str] = []

    @classmethod
    def detect_url(cls, url: str) -> bool:
        """An object-store URL of a ``.tar``, a brace pattern of them, or a prefix (``s3://bucket/shards/``)."""
        last = urlsplit(url).path.rstrip("/").rpartition("/")[2]
        return last.endswith(".tar") or "." not in last

    @classmethod
    def detect(cls, src: Path) -> bool:
        """A ``.tar`` file, a brace pattern of them, or a directory whose visible files are mostly ``.tar``."""
        if _is_pattern(src):
            return src.name.endswith(".tar") and src.parent.is_dir()
        if src.is_file():
            return src.suffix == ".tar"
        if not src.is_dir():
            return False
        try:
            names = [e.name for e in os.scandir(src) if e.is_file() and not e.name.startswith(".")]
        except OSError:
            return False
        tars = sum(n.endswith(".tar") for n in names)
        return tars > 0 and tars * 2 > len(names)

    # ------------------------------------------------------------------ scanning
    def source_root(self) -> Path | str:
        return self.url_root if self.url is not None else self.shards[0].parent

    def describe(self) -> str:
        return location_string(self.url) if self.url is not None else super().describe()

    def input_name(self, item: Any) -> str:
        """``shard#key``, the shard relative to the corpus root (its directory URL for remote shards)."""
        if self.url is None:
            return super().input_name(item)
        return f"{self.sources[item[0]].key}#{item[1]}"

    def source_location(self) -> str:
        return self.url if self.url is not None else super().source_location()

    def _samples(self) -> Iterator[tuple[int, str, list[TarMember], Any]]:
        """Every sample of every shard: ``(shard number, key, members, the shard's open file)``."""
        limit = self.values["max_member_bytes"]
        for s, source in enumerate(self.sources):
            path = source.name
            fh, size = source.open(_WINDOW)
            with fh:
                key: str | None = None
                members: list[TarMember] = []
                unnamed = 0
                for m in read_members(fh, size, path, limit):
                    split = sample_key(m.name)
                    if split is None:
                        unnamed += 1
                        continue
                    if split[0] != key:
                        if key is not None:
                            yield s, key, members, fh
                        key, members = split[0], []
                    members.append(TarMember(split[1], m.offset, m.size, m.refused))
                if key is not None:
                    yield s, key, members, fh
                if unnamed:
                    logger.warning("%s: %d members without an extension belong to no sample and were passed over",
                                   path, unnamed)

    def _first_plan(self, shard: int, key: str, members: list[TarMember], fh: Any) -> _Plan:
        """The plan, from the first usable sample and the options."""
        roles = [m.name for m in members]
        media, member = self.values["media"], self.values["member"]
        if member is not None:
            last = member.rsplit(".", 1)[-1]
            media = media or ("audio" if last in _AUDIO_ROLES else "image")
        else:
            for role in roles:
                last = role.rsplit(".", 1)[-1]
                if media in (None, "image") and last in _IMAGE_ROLES:
                    media, member = "image", role
                    break
                if media in (None, "audio") and last in _AUDIO_ROLES:
                    media, member = "audio", role
                    break
        if member is None or media is None:
            raise ConversionError(
                f"{self.sources[shard].sample(key)}: the first sample has no {media or 'image or audio'} member (members: "
                f"{', '.join('.' + r for r in roles)}); pass {self.label('member')}")
        label = self.values["label"]
        if label is None:
            label = next((r for r in LABEL_ROLES if r in roles), None)
        where = self.sources[shard].sample(key)
        arrays: dict[str, tuple[str, FieldSpec]] = {}
        numbers: dict[str, tuple[str, FieldSpec]] = {}
        taken = set(_RESERVED_FIELDS)
        for m in members:
            if m.name.endswith("npy") and m.name not in (member, label):
                name = m.name[: -len("npy")].rstrip(".").replace(".", "_") or "npy"
                if _FIELD_NAME.fullmatch(name) and name not in taken:
                    _, spec = _npy_spec(_read_at(fh, m.offset, m.size), f"{where}.{m.name}")
                    arrays[m.name] = (name, spec)
                    taken.add(name)
        js = next((m for m in members if m.name == "json"), None)
        if js is not None:
            for k, value in _json_numbers(fh, js.offset, js.size, f"{where}.json").items():
                if _FIELD_NAME.fullmatch(k) and k not in taken:
                    numbers[k] = (k, spec_of(value, k))
                    taken.add(k)
        return _Plan(media, member, label, arrays, numbers)

    def scan(self) -> ScanResult:
        """Every usable sample in shard order (the shards' headers are read once; the result is kept)."""
        if self._scanned is None:
            self._scanned = self._scan()
        return self._scanned

    def _scan(self) -> ScanResult:
        items: list[Sample] = []
        skipped: list[Skip] = []
        texts: list[str] = []
        plan: _Plan | None = None
        for shard, key, members, fh in self._samples():
            where = self.sources[shard].sample(key)
            refused = next((m.refused for m in members if m.refused), None)
            seen = Counter(m.name for m in members)
            twice = next((r for r, n in seen.items() if n > 1), None)
            if refused is None and twice is not None:
                refused = f"duplicate: the sample holds .{twice} {seen[twice]} times"
            if refused is not None:
                skipped.append(Skip(where, refused))
                continue
            if plan is None:
                plan = self._first_plan(shard, key, members, fh)
            label_text = ""
            if plan.label is not None:
                m = next((m for m in members if m.name == plan.label), None)
                if m is None:
                    skipped.append(Skip(where, f"label: no .{plan.label} member"))
                    continue
                if m.size > _MAX_LABEL_BYTES:
                    skipped.append(Skip(where, f"label: .{plan.label} holds {m.size} bytes, at most {_MAX_LABEL_BYTES}"))
                    continue
                label_text = _read_at(fh, m.offset, m.size).decode("utf-8", "replace").strip()
            texts.append(label_text)
            items.append((shard, key, -1, tuple((m.name, m.offset, m.size) for m in members)))
        if plan is None:
            raise ConversionError(f"{self.describe()}: the shards hold no usable sample ({len(skipped)} refused)")
        self._plan = plan
        ids = self._label_ids(texts, items, skipped) if plan.label is not None else [0] * len(items)
        items = [(s, k, i, m) for (s, k, _, m), i in zip(items, ids) if i >= 0]
        if not items:
            raise ConversionError(f"{self.describe()}: no sample has a usable label")
        return ScanResult(items=items, skipped=skipped)

    def _label_ids(self, texts: list[str], items: list[Sample], skipped: list[Skip]) -> list[int]:
        """Class ids of the label texts: the numbers themselves when every one is a whole number (names
        ``"0"``..), else indices into the sorted names; -1 for a sample skipped here."""
        if all(re.fullmatch(r"\d{1,9}", t) for t in texts):
            ids = [int(t) for t in texts]
            for j, i in enumerate(ids):
                if i >= _MAX_CLASSES:
                    skipped.append(Skip(self.sources[items[j][0]].sample(items[j][1]),
                                        f"label: class {i} is beyond {_MAX_CLASSES - 1}"))
                    ids[j] = -1
            self._classes = [str(i) for i in range(max(ids) + 1)] if max(ids, default=-1) >= 0 else []
            return ids
        names = sorted({t for t in texts if t})
        if len(names) > _MAX_CLASSES:
            raise ConversionError(f"{self.describe()}: the .{self._plan.label if self._plan else ''} members name "
                                  f"{len(names)} classes, more than {_MAX_CLASSES}; is it a caption?")
        index = {n: i for i, n in enumerate(names)}
        self._classes = names
        out = []
        for j, t in enumerate(texts):
            if not t:
                skipped.append(Skip(self.sources[items[j][0]].sample(items[j][1]), "label: empty label member"))
            out.append(index.get(t, -1))
        return out

    @property
    def plan(self) -> _Plan:
        if self._plan is None:
            self.scan()
        assert self._plan is not None
        return self._plan

    # ------------------------------------------------------------------ what a record is
    @property
    def payload(self) -> str:  # type: ignore[override]
        """``image`` or ``audio``, as the first sample (or ``media``) says."""
        return self.plan.media

    @property
    def provenance_columns(self) -> tuple[str, ...]:  # type: ignore[override]
        return IMAGE_COLUMNS if self.plan.media == "image" else AUDIO_COLUMNS

    def record_spec(self) -> FieldSpec:
        if self.plan.media == "image":
            return FieldSpec((self.image.height, self.image.width, 3), "uint8")
        return FieldSpec(self.audio.shape, self.audio.dtype)

    def fields(self) -> dict[str, FieldSpec]:
        plan = self.plan
        return {"label": FieldSpec((), "int64"), **dict(plan.arrays.values()), **dict(plan.numbers.values())}

    def labels(self) -> dict[str, list[str]]:
        self.plan  # noqa: B018 - the classes are known once scanned
        return {"label": list(self._classes)}

    def transform(self) -> dict[str, Any]:
        if self.plan.media == "image":
            return dict(self.image.to_json())
        return dict(self.audio.to_json())

    def config(self) -> dict[str, Any]:
        plan = self.plan
        remote = {"src": location_string(self.url)} if self.url is not None else {}
        return {**super().config(), **remote, "pattern": self.pattern, "transform": self.transform(), "classes": self._classes,
                "plan": json.loads(json.dumps({"media": plan.media, "member": plan.member, "label": plan.label,
                                               "arrays": {k: [n, s.to_json()] for k, (n, s) in plan.arrays.items()},
                                               "numbers": {k: [n, s.to_json()] for k, (n, s) in plan.numbers.items()}}))}

    def source(self) -> dict[str, Any]:
        path = self.describe() if self.url is not None else str(self.src / self.pattern) if self.pattern else str(self.src)
        return {**super().source(), "path": path, "shards": len(self.shards)}

    def inputs_fingerprint(self, scan: ScanResult) -> str:
        """The samples (as for every kind) and, for remote shards, each one's size and ETag: a resume over
        shards replaced since the first run is refused (its records would mix two versions)."""
        found = super().inputs_fingerprint(scan)
        if self.url is None:
            return found
        crc = 0
        for source in self.sources:
            crc = zlib.crc32(f"{source.key}\t{source.size}\t{source.etag}\n".encode("utf-8", "surrogateescape"), crc)
        return f"{found}:{crc:08x}"

    def make_decoder(self) -> WebDatasetDecoder:
        plan = self.plan
        return WebDatasetDecoder(self.record_spec(), list(self.sources), plan,
                                 self.image if plan.media == "image" else None,
                                 self.audio if plan.media == "audio" else None)
