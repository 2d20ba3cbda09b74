"""Parsing the sampler's options: tier lists and capacities."""

from __future__ import annotations

import re
from collections.abc import Sequence

from shardkit.errors import ConfigError

__all__ = ["TIERS", "parse_tiers", "parse_capacity"]

#: Known tiers, ordered slow -> fast. ``disk`` (the dataset itself) is implicit.
TIERS = ("ssd", "ram")

_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "M": 1000**2, "MB": 1000**2, "MIB": 1024**2,
          "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "T": 1000**4, "TB": 1000**4, "TIB": 1024**4}
_RECORD_UNITS = {"R", "REC", "RECS", "RECORD", "RECORDS"}


def parse_tiers(tiers: str | Sequence[str]) -> tuple[str, ...]:
    """Normalise ``"ram"``, ``"ram,ssd"``, ``"ssd,ram"`` or ``["ram", "ssd"]`` to slow -> fast order.

    ``ram`` is mandatory (batches are assembled there); ``ssd`` is optional.
    """
    if isinstance(tiers, str):
        names = [t.strip().lower() for t in tiers.split(",") if t.strip()]
    else:
        names = [str(t).strip().lower() for t in tiers]
    unknown = [t for t in names if t not in TIERS]
    if unknown:
        raise ConfigError(f"tiers: expected a comma-separated subset of {', '.join(TIERS)}, found {unknown}")
    if len(set(names)) != len(names):
        raise ConfigError(f"tiers: each tier may appear once, found {names}")
    if "ram" not in names:
        raise ConfigError(f"tiers: 'ram' is required (batches are assembled in RAM), found {names}")
    return tuple(t for t in TIERS if t in names)


def parse_capacity(value: int | str, record_nbytes: int, *, what: str) -> int:
    """A tier capacity in bytes from an int (bytes), ``"2GiB"``/``"500MB"``/``"1048576"``, or a
    record count ``"10000records"`` / ``"10000rec"`` (converted with ``record_nbytes``)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected bytes or a size string, found {value!r}")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).upper() if m else ""
        if not m or (unit not in _UNITS and unit not in _RECORD_UNITS):
            raise ConfigError(
                f"{what}: expected a size such as 512MiB, 2GiB, 1000000 or 10000records, found {value!r}"
            )
        number = float(m.group(1))
        nbytes = int(number * record_nbytes) if unit in _RECORD_UNITS else int(number * _UNITS[unit])
    else:
        raise ConfigError(f"{what}: expected bytes or a size string, found {type(value).__name__} {value!r}")
    if nbytes <= 0:
        raise ConfigError(f"{what}: must be positive, found {value!r}")
    return nbytes
