"""``shardkit convert``: turn a raw corpus into a dataset, with a progress bar and a summary.

The corpus options (``--size``, ``--sample-rate``, ...) are generated from the option schema of every
registered kind (:attr:`shardkit.converters.base.Converter.options`); their text values are parsed by
the kind's own parsers, which name the flag in their errors.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import TYPE_CHECKING, Any

import typer

from shardkit.cli.app import app, echo_err, echo_out, setup_logging
from shardkit.cli.merge import shard_ways
from shardkit.cli.options import flag_parameter, option_parameters
from shardkit.converters.options import Option
from shardkit.converters.progress import progress_bar
from shardkit.converters.registry import available_kinds, kind_options
from shardkit.converters.runoptions import ConversionOptions
from shardkit.stores import is_url
from shardkit.units import human_bytes

if TYPE_CHECKING:
    from shardkit.converters.pipeline import ConvertSummary

__all__ = ["convert", "kind_option_parameters", "print_summary"]

logger = logging.getLogger(__name__)

_KIND_PANEL = "Corpus options (each applies to the kinds it names)"


def _option_help(entries: list[tuple[str, Option]]) -> str:
    """One help text for an option several kinds may declare (differently), as plain text."""
    groups: dict[Option, list[str]] = {}
    for kind, opt in entries:
        groups.setdefault(opt, []).append(kind)
    parts = []
    for opt, kinds in groups.items():
        default = "" if opt.default is None or opt.type is bool else f" Default: {opt.default}."
        parts.append(f"{', '.join(kinds)}: {opt.help}{default}")
    return " ".join(parts)


def kind_option_parameters() -> list[inspect.Parameter]:
    """One keyword parameter (a typer option) per corpus option of every kind.

    Options of the same name must agree on being a flag or taking a value; a kind that disagrees
    keeps its option in Python but not on the command line (logged).
    """
    params = []
    for name, entries in sorted(kind_options().items()):
        is_flag = entries[0][1].type is bool
        agreeing = [(k, o) for k, o in entries if (o.type is bool) == is_flag]
        for kind, _ in entries:
            if (kind, _) not in agreeing:
                logger.warning("kind %s: option %s is a flag for some kinds and takes a value for others; "
                               "not offered on the command line", kind, name)
        flag = agreeing[0][1].flag
        names, annotation, look = ((f"{flag}/--no-{flag[2:]}",), bool | None, {}) if is_flag else \
            ((flag,), str | None, {"metavar": agreeing[0][1].metavar or "VALUE"})
        params.append(flag_parameter(name, annotation, None, *names, help=_option_help(agreeing),
                                     rich_help_panel=_KIND_PANEL, show_default=False, **look))
    return params


#: How the shared options look on the command line (their names, types and help are declared in
#: ConversionOptions): extra short names, metavars, and whether typer shows the default.
_LOOK: dict[str, dict[str, Any]] = {
    "workers": {"short": "-j"},
    "compression": {"metavar": "CODEC"},
    "shard_bytes": {"metavar": "SIZE"},
    "scheduler": {"metavar": "ADDRESS"},
    "part_size": {"metavar": "N"},
    "keep_versions": {"metavar": "N", "show_default": True},
    "staging_dir": {"metavar": "DIR"},
}


def conversion_parameters() -> list[inspect.Parameter]:
    """One keyword parameter (a typer option) per :class:`ConversionOptions` option that has a flag,
    named as the option (``shard_bytes`` is ``--shard-size``); a flag not given passes ``None``, so
    :func:`conversion_options` applies the declared default."""
    return option_parameters(ConversionOptions, look=_LOOK, panels=False, unset_is_none=True)


def conversion_options(given: dict[str, Any], verb: str = "converting") -> ConversionOptions:
    """The shared options out of a command's parsed flags (removed from ``given``; ``None``: not
    given, the declared default), spelled as flags in errors; a scheduler from the environment is
    announced on stderr."""
    from shardkit.converters.executors import DASK_SCHEDULER_ENV, scheduler_address

    names = [p.name for p in conversion_parameters()]
    values = {n: given.pop(n) for n in names if n in given}
    scheduler = values.get("scheduler")
    address = scheduler_address(scheduler)
    values["scheduler"] = address
    if address is not None and scheduler is None:
        echo_err(f"{verb} on the Dask cluster at {address} (from {DASK_SCHEDULER_ENV}; --scheduler local to stay here)")
    return ConversionOptions.parse(source="cli", **{k: v for k, v in values.items() if v is not None})


def _common_parameters() -> list[inspect.Parameter]:
    """The options of the command itself (not of a corpus kind): its own, then the shared ones."""
    def p(name: str, annotation: Any, info: Any) -> inspect.Parameter:
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)

    return [
        p("src", str, typer.Argument(..., metavar="SRC", show_default=False, help=(
            "Corpus: COCO root (or instances_*.json), class folders, CIFAR batches, audio folders, WebDataset "
            "shards (a .tar, a directory of them, or shards-{000..099}.tar; also as s3:// URLs or an "
            "s3://bucket/prefix/), Parquet files."))),
        p("output", str, typer.Option(..., "-o", "--output", metavar="PATH|URL", help=(
            "Output dataset directory, or an object-store URL (s3://bucket/ds, gs://, az://): shards are "
            "uploaded as they complete, metadata last."))),
        p("kind", str | None, typer.Option(None, "--kind", metavar="KIND", show_default=False,
                                           help=f"{', '.join(available_kinds())} (default: detect).")),
        *conversion_parameters(),
        p("quiet", bool, typer.Option(False, "--quiet", "-q", help="No progress bar.")),
        p("verbose", bool, typer.Option(False, "--verbose", "-v",
                                        help="Log every skipped input and annotation entry, with its reason.")),
    ]


def convert(*, src: str, output: str, kind: str | None, quiet: bool, verbose: bool, **given: Any) -> None:
    """Convert a corpus into a dataset; resumable, deterministic whatever --workers or --scheduler."""
    from shardkit.converters import convert as run_convert
    from shardkit.converters import detect_kind, get_converter

    setup_logging(verbose)
    run = conversion_options(given)
    options = {k: v for k, v in given.items() if v is not None}
    kind = kind or detect_kind(src)
    t0 = time.perf_counter()
    with progress_bar(get_converter(kind).progress_unit, f"convert {kind}", disable=quiet) as progress:
        summary = run_convert(src, output, kind, naming="cli", **{**run.run_keywords(), "progress": progress},
                              **options)
    print_summary(summary, append=run.append, started=t0, compression=run.compression)


def print_summary(summary: ConvertSummary, *, append: bool, started: float, compression: str | None = None) -> None:
    """The summary of a conversion on stdout (``convert`` and ``write``): records, skips, bytes, speed,
    and for a run in parts its version, parts and commit, and with ``compression`` what the codec achieved;
    ``started``: ``time.perf_counter()`` at the start."""
    from shardkit.converters.provenance import change_lines

    t0 = started
    if summary.already_complete:
        what = "already holds these records as its latest addition" if append else "already converted with the same parameters"
        echo_out(f"{summary.output}: {what} ({summary.records} records); nothing to do")
        return
    elapsed = max(summary.seconds, time.perf_counter() - t0)
    added = summary.commit.records_added if summary.commit is not None else summary.records
    lines = [
        f"wrote        {added} records to {summary.output}"
        + (f" ({added - summary.records_this_run} by a previous run)" if added != summary.records_this_run else "")
        + (f", {summary.records} in all" if added != summary.records else ""),
        f"skipped      {summary.num_skipped}"
        + (" (" + ", ".join(f"{k}: {v}" for k, v in summary.skipped.items()) + ")" if summary.skipped else ""),
        _bytes_line(summary.bytes, remote=is_url(str(summary.output)),
                    all_new=added == summary.records_this_run == summary.records),
        f"time         {elapsed:.1f} s, {summary.records_this_run / elapsed if elapsed else 0:.1f} records/s",
    ]
    if summary.commit is not None:
        c = summary.commit
        lines.insert(1, f"version      {summary.version}")
        lines.append(f"parts        {summary.parts} ({summary.parts_converted} converted by this run)")
        lines.append(f"commit       {c.seconds:.1f} s: shards {shard_ways(c)}")
    if compression is not None:
        from shardkit.converters.codec_report import compression_lines
        from shardkit.formats import open_dataset

        with open_dataset(summary.output) as ds:
            lines += compression_lines(ds.meta)
    for k, v in summary.notes.items():
        lines.append(f"note         {k}: {v}")
    lines += [f"changed      {line}" for line in change_lines(summary.changes)]
    echo_out("\n".join(lines))


def _bytes_line(nbytes: int, *, remote: bool, all_new: bool) -> str:
    """The dataset's size; said as uploaded only when this run put every byte into an object store."""
    if remote and all_new:
        return f"uploaded     {human_bytes(nbytes)}"
    return f"bytes        {human_bytes(nbytes)}" + (" in the store" if remote else "")


convert.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [*_common_parameters(), *kind_option_parameters()], return_annotation=None
)
app.command("convert")(convert)
