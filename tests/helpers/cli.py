"""Helpers shared by test packages (test packages never import each other's modules).

:func:`run_cli` runs ``shardkit ARGS`` in this process, as :func:`shardkit.cli.main.main` runs it
for a user (its one-line errors and exit codes included), which is several times faster than a
subprocess per call; ``tests/cli/test_help.py`` keeps one subprocess smoke test of the installed
entry point.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CliResult", "run_cli", "run_main"]


@dataclass(frozen=True)
class CliResult:
    """What a run of the CLI left: its exit code and its two output streams (as text)."""

    returncode: int
    stdout: str
    stderr: str


def run_main(*args: str) -> int:
    """Run ``shardkit *args`` in this process and return its exit code; what it prints stays with the
    caller's capture (pytest's ``capsys``)."""
    from shardkit.cli.main import main

    try:
        main(list(args))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def run_cli(*args: str, env: Mapping[str, str | None] | None = None) -> CliResult:
    """Run ``shardkit *args`` in-process with captured stdout/stderr (click's isolation).

    The CLI sets logging up with :func:`logging.basicConfig`, which does nothing under pytest (the
    root logger already has pytest's handlers); a handler on the captured stderr stands in for it, at
    the level the CLI would choose, so warnings reach ``stderr`` as they do for a user.
    """
    from click.testing import CliRunner

    verbose = "-v" in args or "--verbose" in args
    root = logging.getLogger()
    with CliRunner().isolation(env=env) as (out, err, _):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler.setLevel(logging.INFO if verbose else logging.WARNING)
        old_level = root.level
        root.addHandler(handler)
        root.setLevel(min(old_level or logging.WARNING, handler.level))
        try:
            code = run_main(*args)
        finally:
            root.removeHandler(handler)
            root.setLevel(old_level)
            sys.stdout.flush()
            sys.stderr.flush()
        return CliResult(code, out.getvalue().decode("utf-8", "replace"), err.getvalue().decode("utf-8", "replace"))
