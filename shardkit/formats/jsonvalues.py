"""Strict readers of values taken from JSON metadata documents (metadata is hostile input too).

Each returns a value of the expected type inside its bounds (``int(True)`` or ``tuple("12")`` would
quietly accept nonsense) or raises NotADatasetError naming the document, the key, what was expected
and what was found, before anything is allocated from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardkit.errors import NotADatasetError

__all__ = ["member", "integer", "string", "mapping", "array", "shape", "MISSING"]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: Marker for "no default": the key is required.
MISSING: Any = _Missing()


def _found(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def member(doc: Mapping[str, Any], key: str, where: str, default: Any = MISSING) -> Any:
    """``doc[key]``, or ``default``; a missing required key is a NotADatasetError naming ``where``."""
    if key in doc:
        return doc[key]
    if default is MISSING:
        raise NotADatasetError(f"{where}: required key {key!r} is missing")
    return default


def integer(value: Any, what: str, where: str, *, lo: int | None = 0, hi: int | None = None) -> int:
    """An ``int`` (not a bool, not a float) with ``lo <= value <= hi``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise NotADatasetError(f"{where}: {what}: expected an integer, found {_found(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise NotADatasetError(f"{where}: {what}: expected an integer in {bounds}, found {_found(value)}")
    return value


def string(value: Any, what: str, where: str) -> str:
    """A JSON string."""
    if not isinstance(value, str):
        raise NotADatasetError(f"{where}: {what}: expected a string, found {_found(value)}")
    return value


def mapping(value: Any, what: str, where: str) -> dict[str, Any]:
    """A JSON object."""
    if not isinstance(value, dict):
        raise NotADatasetError(f"{where}: {what}: expected a JSON object, found {_found(value)}")
    return value


def array(value: Any, what: str, where: str) -> list[Any]:
    """A JSON array."""
    if not isinstance(value, list):
        raise NotADatasetError(f"{where}: {what}: expected a JSON array, found {_found(value)}")
    return value


def shape(value: Any, what: str, where: str, *, max_ndim: int, lo: int = 1, hi: int | None = None) -> tuple[int, ...]:
    """A list of at most ``max_ndim`` integers, each in ``[lo, hi]``."""
    items = array(value, what, where)
    if len(items) > max_ndim:
        raise NotADatasetError(f"{where}: {what}: expected at most {max_ndim} dimensions, found {len(items)}")
    return tuple(integer(v, f"{what}[{k}]", where, lo=lo, hi=hi) for k, v in enumerate(items))
