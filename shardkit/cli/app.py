"""The typer application object and shared CLI helpers.

Subcommands live in one module each (``info``, ``verify``, ``convert``, ``sample``) and register
themselves on :data:`app` when :mod:`shardkit.cli.main` imports them.
"""

from __future__ import annotations

import logging
import re
import sys

import typer

from shardkit.errors import ConfigError

__all__ = ["app", "parse_size", "human_bytes", "echo_err", "setup_logging"]

app = typer.Typer(
    name="shardkit",
    help=(
        "Convert image/audio corpora into shard files of fixed-size records and read them in an "
        "exactly uniform random order with only sequential storage reads."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "M": 1000**2, "MB": 1000**2, "MIB": 1024**2,
          "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "T": 1000**4, "TB": 1000**4, "TIB": 1024**4}


def parse_size(text: str, *, what: str = "size") -> int:
    """Parse ``"2GiB"``, ``"500MB"``, ``"1048576"`` into bytes (ConfigError on anything else)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"{what}: expected a size such as 512MiB, 2GiB or 1000000, found {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: sizes as a person reads them in summaries."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def echo_err(message: str) -> None:
    """Print one line to stderr."""
    typer.echo(message, err=True)


def setup_logging(verbose: bool) -> None:
    """Library logging to stderr: warnings by default, info with --verbose."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
