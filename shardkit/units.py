"""The one grammar of sizes, record counts, durations and rates, parsed and formatted (docs/design.md §7).

Every error names the option the way the user wrote it (``--ram-size`` or ``ram_size``); sizes are
shown in IEC units (``human_bytes(1536) == "1.5 KiB"``).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import SupportsIndex, TypeGuard

from shardkit.errors import ConfigError

__all__ = [
    "Capacity",
    "parse_bytes",
    "parse_capacity",
    "parse_count",
    "parse_duration",
    "parse_rate",
    "human_bytes",
    "human_count",
]

_SI = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3, "GB": 1000**3,
       "T": 1000**4, "TB": 1000**4, "P": 1000**5, "PB": 1000**5}
_IEC = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4, "PIB": 1024**5}
_BYTE_UNITS = {**_SI, **_IEC}
_RECORD_UNITS = {"R", "REC", "RECS", "RECORD", "RECORDS"}
_COUNT_UNITS = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3}
_DURATION_UNITS = {"": 1.0, "S": 1.0, "SEC": 1.0, "MS": 1e-3, "US": 1e-6, "M": 60.0, "MIN": 60.0, "H": 3600.0}
_RATE_UNITS = {"": 1, "HZ": 1, "K": 1000, "KHZ": 1000, "M": 1000**2, "MHZ": 1000**2}
_NUMBER = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z]*)\s*")


def _split(text: str) -> tuple[float, str] | None:
    m = _NUMBER.fullmatch(text)
    if m is None:
        return None
    number = float(m.group(1) + (f"e{m.group(2)}" if m.group(2) else ""))
    return number, m.group(3).upper()


def _is_int(value: object) -> TypeGuard[SupportsIndex]:
    # numpy integers count; bools do not (True is not a size).
    return not isinstance(value, bool) and hasattr(value, "__index__")


@dataclass(frozen=True)
class Capacity:
    """A parsed budget, ``nbytes`` or ``records``, resolved once the record size is known (:meth:`to_bytes`)."""

    nbytes: int | None = None
    records: int | None = None

    def to_bytes(self, record_nbytes: int) -> int:
        """The budget in bytes for records of ``record_nbytes`` bytes."""
        if self.records is not None:
            return self.records * int(record_nbytes)
        assert self.nbytes is not None
        return self.nbytes

    def __str__(self) -> str:
        return f"{self.records}records" if self.records is not None else human_bytes(self.nbytes or 0)


def parse_bytes(value: int | str, *, what: str, allow_zero: bool = False) -> int:
    """Bytes from an int or a size string (``"512MiB"``, ``"2GB"``, ``"1.5 KiB"``); ConfigError naming ``what``.

    SI units (``K``/``kB``, ``M``, ``G``, ``T``, ``P``) are powers of 1000, IEC units (``KiB`` ...)
    powers of 1024; case is ignored and a fraction is rounded down (``1.5KiB`` = 1536). ``allow_zero``
    accepts 0 (an option that is off).
    """
    if _is_int(value):
        nbytes = operator.index(value)
    elif isinstance(value, str):
        parsed = _split(value)
        if parsed is None or parsed[1] not in _BYTE_UNITS:
            raise ConfigError(f"{what}: expected a size such as 512MiB, 2GB or 1048576, found {value!r}")
        nbytes = int(math.floor(parsed[0] * _BYTE_UNITS[parsed[1]]))
    else:
        raise ConfigError(f"{what}: expected a size (bytes or a string such as 512MiB), found {value!r}")
    if nbytes < 0 or (nbytes == 0 and not allow_zero):
        raise ConfigError(f"{what}: expected a {'non-negative' if allow_zero else 'positive'} size, found {value!r}")
    return nbytes


def parse_capacity(value: int | str | Capacity, *, what: str, allow_zero: bool = False) -> Capacity:
    """A tier budget: bytes (as :func:`parse_bytes`) or a record count (``"10000records"``, ``"10000rec"``,
    ``"10000r"``). ``allow_zero`` also accepts ``"off"`` and ``"none"`` as a zero budget."""
    if isinstance(value, Capacity):
        return value
    if isinstance(value, str):
        if allow_zero and value.strip().lower() in ("off", "none", ""):
            return Capacity(nbytes=0)
        parsed = _split(value)
        if parsed is not None and parsed[1] in _RECORD_UNITS:
            number = parsed[0]
            if number != int(number) or number < 0 or (number == 0 and not allow_zero):
                raise ConfigError(f"{what}: expected a positive whole number of records, found {value!r}")
            return Capacity(records=int(number))
        if parsed is None or parsed[1] not in _BYTE_UNITS:
            raise ConfigError(
                f"{what}: expected a size such as 512MiB, 2GB, 1048576 or 10000records, found {value!r}"
            )
    return Capacity(nbytes=parse_bytes(value, what=what, allow_zero=allow_zero))


def parse_count(value: int | str, *, what: str, minimum: int = 0) -> int:
    """A whole count (``10``, ``"10k"`` = 10000: SI multipliers) of at least ``minimum``."""
    if _is_int(value):
        count = operator.index(value)
    elif isinstance(value, str):
        parsed = _split(value)
        if parsed is None or parsed[1] not in _COUNT_UNITS or parsed[0] * _COUNT_UNITS[parsed[1]] % 1:
            raise ConfigError(f"{what}: expected a whole number such as 10 or 10k, found {value!r}")
        count = int(parsed[0] * _COUNT_UNITS[parsed[1]])
    else:
        raise ConfigError(f"{what}: expected a whole number, found {value!r}")
    if count < minimum:
        raise ConfigError(f"{what}: expected a whole number >= {minimum}, found {value!r}")
    return count


def _parse_quantity(value: float | int | str, table: Mapping[str, float], *, what: str, example: str) -> float:
    """A number, or a number with a unit of ``table`` (``"1.5s"``) scaled to its base unit; ``example``
    completes the error message."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{what}: expected {example}, found {value!r}")
    if isinstance(value, (int, float)) or _is_int(value):
        return float(value)
    parsed = _split(value)
    if parsed is None or parsed[1] not in table:
        raise ConfigError(f"{what}: expected {example}, found {value!r}")
    return float(parsed[0] * table[parsed[1]])


def parse_duration(value: float | int | str, *, what: str, allow_zero: bool = True) -> float:
    """Seconds from a number or ``"1.5s"``, ``"20ms"``, ``"2m"``/``"2min"``, ``"1h"``."""
    seconds = _parse_quantity(value, _DURATION_UNITS, what=what, example="a duration such as 1.5s, 20ms or 2min")
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise ConfigError(f"{what}: expected a {'non-negative' if allow_zero else 'positive'} duration, found {value!r}")
    return seconds


def parse_rate(value: int | float | str, *, what: str) -> int:
    """A positive whole rate in hertz from ``16000``, ``"16k"``, ``"16kHz"`` or ``"44.1k"``."""
    hz = _parse_quantity(value, _RATE_UNITS, what=what, example="a rate such as 16000, 16k or 44.1kHz")
    if not math.isfinite(hz) or hz <= 0 or hz != int(hz):
        raise ConfigError(f"{what}: expected a positive whole number of hertz, found {value!r}")
    return int(hz)


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: sizes as a person reads them (IEC units, as everywhere in shardkit)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def human_count(n: int, noun: str) -> str:
    """``(1, "shard")`` -> ``"1 shard"``, ``(3, "shard")`` -> ``"3 shards"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
