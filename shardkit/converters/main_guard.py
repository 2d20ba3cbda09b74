"""Decode workers and the calling script: start them so a script without a ``__main__`` guard works.

:func:`start_method` forks the workers when that is safe (:func:`fork_is_safe`: they start with the
caller's imports) or when ``forkserver``/``spawn`` would re-run a main script whose running statement is
not under the guard (or decodes in-process where there is no ``fork``), and
:func:`refuse_inside_worker_start` stops a conversion started by such a re-run (docs/design.md §5).
"""

from __future__ import annotations

import ast
import logging
import multiprocessing as mp
import os
import sys
import tokenize
from collections.abc import Sequence
from multiprocessing.context import BaseContext
from types import FrameType, ModuleType

from shardkit.errors import ConversionError
from shardkit.processes import fork_state

__all__ = ["GUARD", "fork_is_safe", "workers_rerun_main", "call_is_guarded", "start_method", "worker_context",
           "refuse_inside_worker_start"]

logger = logging.getLogger(__name__)

#: The guard, as written in messages.
GUARD = 'if __name__ == "__main__":'
#: The name multiprocessing runs the main script under in a child.
_CHILD_MAIN = "__mp_main__"


def workers_rerun_main(main: ModuleType | None = None) -> bool:
    """Whether forkserver / spawn workers re-run the main module (as ``multiprocessing.spawn`` decides):
    a script file or ``python -m pkg.mod``, not a package's ``__main__.py`` nor an interactive session."""

    main = sys.modules.get("__main__") if main is None else main
    if main is None:
        return False
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return name != "__main__" and not name.endswith(".__main__")
    path = getattr(main, "__file__", None)
    return path is not None and os.path.splitext(os.path.basename(path))[0] != "ipython" and os.path.exists(path)


def _main_frame(main: ModuleType) -> FrameType | None:
    """The frame running the main module's top-level code, if this call came from it."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is main.__dict__:
            return frame
        frame = frame.f_back
    return None


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def call_is_guarded(main: ModuleType | None = None) -> bool | None:
    """Whether the main script's statement that led to this call sits inside a ``__main__`` guard;
    ``None`` when that cannot be told (no script file, not called from its top level, does not parse)."""
    main = sys.modules.get("__main__") if main is None else main
    path = getattr(main, "__file__", None)
    if main is None or path is None:
        return None
    frame = _main_frame(main)
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        with tokenize.open(path) as fh:
            tree = ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    for stmt in tree.body:
        if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
            return isinstance(stmt, ast.If) and _is_main_test(stmt.test) and any(
                s.lineno <= line <= (s.end_lineno or s.lineno) for s in stmt.body)
    return None


def fork_is_safe() -> bool:
    """Whether decode workers may be forked from this process right now: on Linux, with no Python
    thread but the calling one and none of :data:`~shardkit.processes.FORK_UNSAFE_MODULES` loaded
    (:func:`~shardkit.processes.fork_state`). A forked worker starts with the caller's imports and
    decoder already loaded instead of a fresh interpreter importing them (about 1 ms of CPU per image
    over 800 images at 2 workers, ``benchmarks/write.py``)."""
    state = fork_state()
    return state.linux and state.fork and state.threads == 1 and not state.native_runtimes


def start_method(workers: int) -> str | None:
    """How to start ``workers`` decode processes for this caller: a multiprocessing start method, or
    ``None`` to decode in the calling process (one line logged says why)."""
    methods = mp.get_all_start_methods()
    preferred = "fork" if fork_is_safe() else "forkserver" if "forkserver" in methods else "spawn"
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is not None and getattr(main, "__spec__", None) is None and not os.path.exists(path):
        # A program read from stdin or typed with ``python -c`` has no file for workers to import.
        logger.warning("the calling program has no importable main file (%s): decoding in this process instead of "
                       "%d workers", path, workers)
        return None
    if not workers_rerun_main(main) or call_is_guarded(main) is not False:
        return preferred
    if "fork" in methods:
        logger.info("%s calls shardkit.convert() outside `%s`: forking the %d decode workers so they do not run "
                    "the script again", path, GUARD, workers)
        return "fork"
    logger.warning("%s calls shardkit.convert() outside `%s`: decoding in this process instead of %d workers "
                   "(worker processes would run the script again); put the call under the guard to use them",
                   path, GUARD, workers)
    return None


def worker_context(method: str, modules: Sequence[str]) -> BaseContext:
    """The multiprocessing context for ``method``; with ``forkserver``, ``modules`` are added to the
    fork server's preload list (effective only until this process's fork server has started)."""
    ctx = mp.get_context(method)
    if method == "forkserver":
        from multiprocessing import forkserver

        # The list has no public getter: keep whatever the program asked for, and add ours.
        current = list(getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", None) or ["__main__"])
        wanted = current + [m for m in modules if m not in current]
        if wanted != current:
            ctx.set_forkserver_preload(wanted)
    return ctx


def adopt_environment(environ: dict[str, str]) -> None:
    """In a worker: take the caller's environment as it was when the pool started. A fork server
    keeps the environment it started with, so without this a worker would miss credentials or an
    endpoint the program set since its first conversion (a notebook's second conversion)."""
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)


def refuse_inside_worker_start() -> None:
    """ConversionError when the caller is the top level of the main script re-run as ``__mp_main__``
    by a worker process starting."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == _CHILD_MAIN:
            raise ConversionError(
                f"{frame.f_code.co_filename}: shardkit.convert() was called again by a worker process starting "
                f"up (it re-runs the script); put the call under `{GUARD}`"
            )
        frame = frame.f_back
