"""The conversion progress bar: tqdm, shown where a person watches (``shardkit convert`` unless
``--quiet``; :func:`shardkit.convert` when standard error is a terminal)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["progress_bar"]


@contextmanager
def progress_bar(unit: str, desc: str, *, disable: bool | None = None) -> Iterator[Callable[[int, int, int], None]]:
    """A ``progress(inputs_done, inputs_total, records)`` callback drawing a tqdm bar of ``unit`` (``img``)
    labelled ``desc``, created at the first call and closed on exit; logging goes through tqdm meanwhile.
    ``disable``: ``True`` no bar, ``False`` always, ``None`` only when standard error is a terminal.
    tqdm is imported only for a bar that may be shown (its import costs ~0.1 s of CPU, paid serially)."""
    if disable is None and not (sys.stderr is not None and sys.stderr.isatty()):
        disable = True  # what tqdm decides for a stream that is not a terminal
    bar: Any = None

    def progress(done: int, total: int, records: int) -> None:
        nonlocal bar
        if disable is True:
            return
        if bar is None:
            from tqdm import tqdm

            bar = tqdm(total=total, initial=done, unit=unit, desc=desc, dynamic_ncols=True, smoothing=0.1,
                       disable=disable)
            return
        bar.update(done - bar.n)
        bar.set_postfix_str(f"{records} records", refresh=False)  # a cluster conversion: counted on every worker

    try:
        if disable is True:
            yield progress
        else:
            from tqdm.contrib.logging import logging_redirect_tqdm

            with logging_redirect_tqdm():
                yield progress
    finally:
        if bar is not None:
            bar.close()
