"""Functions for ``shardkit.write`` tests: importable by worker processes and Dask workers
(``tests.converters.write_fns:NAME``). Each gives the same records for the same input."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from shardkit.errors import InputFileError


def tile(i: Any) -> dict[str, Any]:
    """One record per input: a 6x5x3 uint8 image, a class label and a float score."""
    n = int(i)
    rng = np.random.default_rng(n)
    return {"image": rng.integers(0, 256, (6, 5, 3), dtype=np.uint8), "label": n % 4, "score": n / 8}


def windows(i: Any) -> Iterator[dict[str, Any]]:
    """``int(i) % 4`` records per input (none for multiples of 4): windows of a signal."""
    n = int(i)
    for k in range(n % 4):
        yield {"signal": np.full((16,), n * 10 + k, np.float32), "window": k}


def long_recording(i: Any) -> Iterator[dict[str, Any]]:
    """Input ``i`` gives ``i`` records of 1 MiB: more than one decode call (4 MiB) each for i > 4."""
    n = int(i)
    for k in range(n):
        yield {"audio": np.full((1 << 18,), n * 1000 + k, np.float32), "k": k}


def some_do_not_fit(i: Any) -> dict[str, Any]:
    """Input 3 has the wrong shape, input 5 a label that is not a number, input 7 an extra key."""
    n = int(i)
    image = np.full((4, 4) if n == 3 else (4, 4, 3), n, np.uint8)
    rec: dict[str, Any] = {"image": image, "label": "cat" if n == 5 else n}
    if n == 7:
        rec["extra"] = 1
    return rec


def fails_on_4(i: Any) -> dict[str, Any]:
    """Raises for input 4 (the run stops, naming it) until ``$WRITE_FNS_FIXED`` is set; input 2 is
    skipped on purpose."""
    n = int(i)
    if n == 4 and not os.environ.get("WRITE_FNS_FIXED"):
        raise ValueError("no such scan")
    if n == 2:
        raise InputFileError(str(i), "unreadable: the scan is empty")
    return {"x": np.full((8,), n, np.int16)}


def from_path(path: Any) -> dict[str, Any]:
    """A record from a text file's bytes (the CLI passes each input as a str)."""
    data = np.frombuffer(open(os.fspath(path), "rb").read().ljust(8, b"\0")[:8], np.uint8)
    return {"bytes": data.copy(), "size": os.path.getsize(path)}


def scaled(i: Any, factor: int = 1) -> dict[str, Any]:
    """One record ``[i * factor] * 4``: used through ``functools.partial``."""
    return {"x": np.full((4,), int(i) * factor, np.int32)}


NOT_A_FUNCTION = 3


def tile_and_pid(i: Any) -> dict[str, Any]:
    """:func:`tile`'s image and the id of the process that ran ``fn``; input 2 is skipped on purpose."""
    n = int(i)
    if n == 2:
        raise InputFileError(str(i), "unreadable: the scan is empty")
    return {"image": tile(n)["image"], "pid": os.getpid()}
