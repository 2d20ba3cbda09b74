"""``shardkit serve``: one tier stack on this machine that this user's training jobs attach to by name."""

from __future__ import annotations

import typer

from shardkit.cli.app import app, echo_err, echo_out, setup_logging
from shardkit.cli.options import options_command
from shardkit.readers.sources import source_of
from shardkit.serve.server import ServeOptions, TierServer
from shardkit.serve.server import serve as run_server
from shardkit.units import human_bytes


@app.command()
@options_command(ServeOptions)
def serve(
    paths: list[str] = typer.Argument(
        ..., help="Dataset directory or URL (s3://bucket/ds, gs://, az://, http(s)://); several for a mixture (see --weights)."),
    weights: str = typer.Option(
        None, "--weights", help="Serve a mixture of the datasets with these relative weights, comma-separated (3,1); "
                                "default with several datasets: their sizes.",
    ),
    epoch_size: str = typer.Option(
        None, "--epoch-size", help="Records per epoch of a mixture (default: the sum of the datasets' sizes)."),
    name: str = typer.Option("default", "--name", help="Name jobs attach to: SharedSampler(NAME) or shared=NAME."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log jobs attaching and leaving, and each epoch."),
    *,
    options: ServeOptions,
) -> None:
    """Serve a dataset to this user's jobs on this machine: each reservoir is read once, each job gets its own uniform order."""
    setup_logging(verbose)
    def ready(server: TierServer) -> None:
        what = server.path if server.mixture is None else server.mixture.describe()
        echo_err(
            f"serving {what} as {server.name!r} (pid {server.info.pid if server.info else '?'}): {server.slots} "
            f"slots of {server.slot_records} records in shared memory; attach with SharedSampler({server.name!r}, ...)"
        )

    dataset = source_of(paths, weights, epoch_size, source="cli")
    server = run_server(dataset, name=name, ready=ready, options=options)
    st = server.stats
    ssd = (f"; SSD tier {human_bytes(st.ssd_bytes_written)} written, {human_bytes(st.ssd.bytes_read)} read"
           if server.ssd_block is not None else "")
    echo_out(
        f"served {server.epochs_served} epochs, {server.published} reservoir blocks; disk {human_bytes(st.disk.bytes_read)} "
        f"read in {st.disk.read_calls} calls{ssd}"
    )

