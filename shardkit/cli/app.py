"""The typer application object and shared CLI helpers; each subcommand's module registers itself
on :data:`app` when :mod:`shardkit.cli.main` imports it."""

from __future__ import annotations

import logging
import sys

import typer

from shardkit._version import __version__
from shardkit.redact import redact_urls

__all__ = ["app", "echo_err", "echo_out", "help_text", "setup_logging"]

app = typer.Typer(
    name="shardkit",
    help=(
        "Convert image/audio corpora into shard files of fixed-size records and read them in an "
        "exactly uniform random order with only sequential storage reads."
    ),
    no_args_is_help=True,
    # --install-completion / --show-completion for bash, zsh, fish and PowerShell (see the README).
    add_completion=True,
    pretty_exceptions_enable=False,
)


def help_text(text: str) -> str:
    """``text`` for a help string: typer renders help as rich markup, where ``[viz]`` or ``[epochs, N]``
    would be taken for a style tag and vanish (``pip install "shardkit"``), so every ``[`` is escaped."""
    return text.replace("[", "\\[")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"shardkit {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", help="Print the shardkit version and exit.", callback=_print_version, is_eager=True
    ),
) -> None:
    """Convert image/audio corpora into shard files of fixed-size records and read them in an
    exactly uniform random order with only sequential storage reads."""


def echo_out(message: str) -> None:
    """Print to stdout, URLs in it redacted (outputs and summaries name the locations given)."""
    typer.echo(redact_urls(message))


def echo_err(message: str) -> None:
    """Print one line to stderr, URLs in it redacted (a message may quote what the user typed)."""
    typer.echo(redact_urls(message), err=True)


class RedactingFilter(logging.Filter):
    """Redacts the URLs of every record a handler prints (libraries below shardkit log URLs too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        redacted = redact_urls(text)
        if redacted != text:
            record.msg, record.args = redacted, None
        return True


def setup_logging(verbose: bool) -> None:
    """Library logging to stderr: warnings by default, info with --verbose; URLs redacted."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RedactingFilter())
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        handlers=[handler],
    )
