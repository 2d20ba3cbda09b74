"""A record's layout taken from the first record, then enforced on every later one.

Every kind whose fields are not known before the data is read — ``shardkit.write`` (a dict of arrays),
``webdataset`` (``.npy`` members and ``.json`` numbers), ``parquet`` (numeric columns), the row-shard
importers (an array payload) — infers the shape and dtype of each value from the first record and
then checks each later record against them. :class:`RecordLayout` is that one rule: :meth:`infer`
from a first record, :meth:`check` a later one, a value that does not fit becomes
``InputFileError(input, "mismatch: ...")`` naming the input (a skip, or a stop under ``strict``, as
for every other bad input). docs/design.md §5.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit.errors import ConversionError, InputFileError, SchemaError
from shardkit.formats import FieldSpec

__all__ = ["Mismatch", "RecordLayout", "as_array", "fit", "spec_of"]

_NUMERIC_KINDS = "biufc"
#: The dtype kinds a Python number of each kind (bool, int, float, complex) may be stored as.
_HOLDS = {"b": "biufc", "i": "iufc", "f": "fc", "c": "c"}


class Mismatch(Exception):
    """A value that does not fit its key's spec (the message says what differs)."""


def as_array(value: Any, key: str) -> np.ndarray:
    """``value`` as a numeric array (Python numbers, numpy arrays and scalars, nested lists of numbers)."""
    try:
        arr = np.asarray(value)
    except Exception as exc:
        raise Mismatch(f"{key!r} is a {type(value).__name__} that is not an array ({exc})") from None
    if arr.dtype.kind not in _NUMERIC_KINDS:
        raise Mismatch(f"{key!r} is a {type(value).__name__} of dtype {arr.dtype}; expected numbers or a numeric array")
    return arr


def spec_of(value: Any, key: str) -> FieldSpec:
    """The spec of ``value`` as :func:`as_array` reads it; Mismatch when it cannot be a field."""
    arr = as_array(value, key)
    try:
        return FieldSpec(arr.shape, arr.dtype.name)
    except SchemaError as exc:
        raise Mismatch(f"{key!r}: {exc}") from None


def fit(value: Any, spec: FieldSpec, key: str) -> np.ndarray:
    """``value`` as an array of exactly ``spec`` (arrays: same shape, a safe cast; Python numbers: any
    that the dtype holds); Mismatch saying what differs."""
    if isinstance(value, (bool, int, float, complex)) and not isinstance(value, np.generic):
        if spec.shape != ():
            raise Mismatch(f"{key!r} is a number, expected shape {tuple(spec.shape)}")
        kind = "b" if isinstance(value, bool) else "i" if isinstance(value, int) else "f" if isinstance(value, float) else "c"
        target = np.dtype(spec.dtype).kind
        if target not in _HOLDS[kind]:
            raise Mismatch(f"{key!r} is a {type(value).__name__}, expected {spec.dtype}")
        try:
            out = np.asarray(value, dtype=spec.dtype)
        except (OverflowError, ValueError):
            raise Mismatch(f"{key!r} = {value!r} does not fit {spec.dtype}") from None
        if target in "iu" and out.item() != value:
            raise Mismatch(f"{key!r} = {value!r} does not fit {spec.dtype}")
        return out
    arr = as_array(value, key)
    if arr.shape != tuple(spec.shape):
        raise Mismatch(f"{key!r} has shape {arr.shape}, expected {tuple(spec.shape)}")
    if not np.can_cast(arr.dtype, spec.dtype, "safe"):
        raise Mismatch(f"{key!r} has dtype {arr.dtype}, expected {spec.dtype} (or one that casts to it safely)")
    return np.ascontiguousarray(arr, dtype=spec.dtype)


@dataclass(frozen=True)
class RecordLayout:
    """The spec of each key of a record; ``exact``: a record must have no other key (else other keys are
    dropped); ``hint`` ends the message of a record with keys the first had not."""

    specs: Mapping[str, FieldSpec]
    exact: bool = True
    hint: str = ""

    @classmethod
    def infer(cls, first: Mapping[str, Any], where: str, *, exact: bool = True, hint: str = "") -> RecordLayout:
        """The layout of ``first`` (every key); ConversionError naming ``where`` when a value cannot be
        a field (not numeric, no valid spec): the first record decides, so it must be one."""
        specs = {}
        for key, value in first.items():
            try:
                specs[key] = spec_of(value, key)
            except Mismatch as exc:
                raise ConversionError(f"{where}: {exc}") from None
        return cls(specs, exact, hint)

    def describe(self) -> str:
        return ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in self.specs.items())

    def check(self, rec: Mapping[str, Any], where: str, what: str = "the record") -> dict[str, np.ndarray]:
        """``rec``'s values as arrays of the layout; ``InputFileError(where, "mismatch: <what> ...")``
        naming the input when a key is missing, one is extra (``exact``) or a value does not fit."""
        missing = [k for k in self.specs if k not in rec]
        if missing:
            raise InputFileError(where, f"mismatch: {what} has no {', '.join(map(repr, missing))} "
                                        f"(expected {self.describe()})")
        if self.exact:
            extra = [k for k in rec if k not in self.specs]
            if extra:
                raise InputFileError(where, f"mismatch: {what} has key(s) {', '.join(map(repr, extra[:5]))} the first "
                                            f"record had not (expected {self.describe()}{self.hint})")
        out: dict[str, np.ndarray] = {}
        for key, spec in self.specs.items():
            try:
                out[key] = fit(rec[key], spec, key)
            except Mismatch as exc:
                raise InputFileError(where, f"mismatch: {what}: {exc}") from None
        return out
