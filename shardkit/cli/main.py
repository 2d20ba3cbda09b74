"""Entry point of the ``shardkit`` console script: every failure becomes one line on stderr and a
non-zero exit code, a traceback only with ``SHARDKIT_DEBUG=1`` (docs/design.md §7)."""

from __future__ import annotations

import importlib
import os
import sys

from shardkit.cli.app import app, echo_err
from shardkit.errors import ShardkitError

__all__ = ["main", "COMMAND_MODULES"]

#: Modules that each register one subcommand on the app.
COMMAND_MODULES = ("convert", "write", "merge", "publish", "info", "show", "export", "verify", "sample", "serve", "order_test", "profile")
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


def _register_commands() -> None:
    for name in COMMAND_MODULES:
        try:
            importlib.import_module(f"shardkit.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"shardkit.cli.{name}":  # a missing dependency is a real error
                raise


def main(argv: list[str] | None = None) -> None:
    """Run the CLI and exit with its code (0 ok, 1 error, 2 usage, 130 interrupted)."""
    _register_commands()
    debug = os.environ.get("SHARDKIT_DEBUG") == "1"
    try:
        app(args=argv, prog_name="shardkit")
    except KeyboardInterrupt:
        echo_err("interrupted")
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:
        if debug:
            raise
        if isinstance(exc, (ShardkitError, OSError)):  # an OSError names its file (ENOSPC, EACCES, ...)
            echo_err(f"error: {exc}")
        else:
            echo_err(f"internal error: {type(exc).__name__}: {exc} (set SHARDKIT_DEBUG=1 for a traceback)")
        sys.exit(EXIT_ERROR)


if __name__ == "__main__":
    main()
