"""The options every conversion takes, declared once: :class:`ConversionOptions`.

``shardkit.convert`` and ``shardkit.write`` parse their shared keywords (workers, sizes, parts, append,
...) through it, and ``shardkit convert`` / ``shardkit write`` derive their shared flags from it
(:func:`shardkit.cli.convert.conversion_parameters`), so an option cannot exist in one entry point and
not the other (tests/converters/test_options_declared.py checks every consumer). What is specific to
one entry point stays there: the corpus and its kind options (``convert``), the function, inputs and
record layout (``write``). docs/design.md §7 describes the declaration machinery.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from shardkit.declare import Parser, UserOptions, count, option
from shardkit.errors import ConfigError
from shardkit.formats.codecs import codec_usage
from shardkit.formats.spec import DEFAULT_SHARD_BYTES
from shardkit.formats.versions import DEFAULT_KEEP_VERSIONS
from shardkit.units import parse_bytes

__all__ = ["ConversionOptions", "RUN", "OUTPUT"]

#: ``--help`` panels of the options (the :attr:`~shardkit.declare.Option.group`).
RUN, OUTPUT = "Run", "Output"


def _optional(parse: Parser) -> Parser:
    def optional(value: Any, what: str) -> Any:
        return None if value is None else parse(value, what)

    return optional


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{what}: expected True or False, found {value!r}")
    return value


def _text(value: Any, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{what}: expected a text, found {type(value).__name__}")
    return value


def _compression(value: Any, what: str) -> str | None:
    """A codec name; ``"none"`` (any case) is no codec, as on the command line."""
    text = _text(value, what)
    return None if text is None or text.lower() == "none" else text


def _bytes(value: Any, what: str) -> int:
    return parse_bytes(value, what=what)


def _path(value: Any, what: str) -> Path | None:
    if value is None:
        return None
    try:
        return Path(value)
    except TypeError:
        raise ConfigError(f"{what}: expected a directory path, found {type(value).__name__}") from None


def _any(value: Any, what: str) -> Any:
    return value  # checked where it is used (a callable or a bool; an Executor)


@dataclass(frozen=True)
class ConversionOptions(UserOptions):
    """How a conversion runs and what it writes, shared by ``convert`` and ``write`` (see the module
    docstring). Options without a flag exist in Python only (a callback, an executor object)."""

    KIND: ClassVar[str] = "conversion option"

    workers: int | None = option(None, RUN, _optional(count(1)), cli_type=int | None,
                                 help="Decode processes (default: cores). Output does not depend on it.")
    strict: bool = option(False, RUN, _flag, cli_type=bool, flag="--strict",
                          help="Stop at the first bad input instead of skipping it.")
    overwrite: bool = option(False, OUTPUT, _flag, cli_type=bool, flag="--overwrite",
                             help="Replace an existing output (default: resume or refuse).")
    compression: str | None = option(None, OUTPUT, _compression, cli_type=str | None,
                                     help=f"Per-record codec (default none): {codec_usage()}; auto (lossless, "
                                          "after showing what the others give). See docs/codecs.md.")
    shard_bytes: int = option(DEFAULT_SHARD_BYTES, OUTPUT, _bytes, flag="--shard-size", cli_type=str | None,
                              help=("Target shard file size, e.g. 64MiB (default 256MiB); records below 4 KiB "
                                    "make smaller shards: at most one record per 4 KiB, so the index stays small."))
    records_per_shard: int | None = option(None, OUTPUT, _optional(count(1)), flag=None,
                                           help="An exact number of records per shard (instead of shard_bytes).")
    progress: Any = option(None, RUN, _any, flag=None, help=(
        "Called as progress(inputs_done, inputs_total, records) after every input; None: a progress bar when "
        "standard error is a terminal; True always, False never."))
    executor: Any = option(None, RUN, _any, flag=None, help=(
        "Any concurrent.futures.Executor: the parts run on it (same result)."))
    scheduler: str | None = option(None, RUN, _text, cli_type=str | None, help=(
        "Run the conversion in parts on this Dask cluster (tcp://host:8786; default: $DASK_SCHEDULER_ADDRESS "
        "if set; 'local' for this machine). Workers must see SRC and the output at the same paths."))
    append: bool = option(False, OUTPUT, _flag, cli_type=bool, flag="--append", help=(
        "Add SRC's records after those of the dataset at the output, as its next version (same kind, record "
        "shape and transform); readers that opened it keep their version."))
    part_size: int | None = option(None, RUN, _optional(count(1)), cli_type=str | None, help=(
        "Convert in parts of N inputs (default with --scheduler or --append: about 64 parts, 1 to 16 shards "
        "each). Without --scheduler the parts run on --workers local processes, each writing its own shards."))
    keep_versions: int = option(DEFAULT_KEEP_VERSIONS, OUTPUT, count(0), help=(
        "Older versions kept openable after an append; older ones are deleted."))
    staging_dir: Path | None = option(None, OUTPUT, _path, cli_type=Path | None, help=(
        "For a URL output: where each shard is written before its upload (default: the temp dir)."))

    def run_keywords(self) -> dict[str, Any]:
        """The values as :func:`shardkit.converters.partrun.run_conversion` takes them."""
        return {name: getattr(self, name) for name in self.declared()}
