"""``shardkit serve``: one tier stack on this machine that this user's training jobs attach to by name."""

from __future__ import annotations

from pathlib import Path

import typer

from shardkit.cli.app import app, echo_err, echo_out, setup_logging
from shardkit.readers.shared.server import SERVE_DEFAULTS, ServeOptions, TierServer
from shardkit.readers.shared.server import serve as run_server
from shardkit.readers.sources import source_of
from shardkit.units import human_bytes

#: The defaults the flags show and pass: the library's own.
_D = SERVE_DEFAULTS


@app.command()
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
    tiers: str = typer.Option(",".join(_D.tiers), "--tiers", help="'ram' or 'ram,ssd'."),
    ram_size: str = typer.Option(
        str(_D.ram_size), "--ram-size",
        help="The shared-memory ring: --slots slots of ram-size/slots each (bytes like 2GiB, or 10000records).",
    ),
    ssd_size: str = typer.Option(str(_D.ssd_size), "--ssd-size", help="SSD-tier budget: two reservoirs of half of it."),
    ssd_dir: Path = typer.Option(None, "--ssd-dir", help="Directory for the SSD reservoirs (default: temp dir)."),
    seed: int = typer.Option(_D.seed, "--seed", help="Seeds the server's partition of every epoch into reservoirs."),
    epochs: str = typer.Option(None, "--epochs", help="Serve this many epochs, then stop (default: until SIGTERM/Ctrl-C)."),
    slots: str = typer.Option(
        str(_D.slots), "--slots",
        help="Ring slots (>= 2); a slow job holds the others back by at most this many reservoirs.",
    ),
    wait_for: str = typer.Option(str(_D.wait_for), "--wait-for", help="Jobs to wait for before the first epoch."),
    lease: str = typer.Option(
        f"{_D.lease_seconds:g}s", "--lease",
        help="A job silent this long is dropped, and a job hearing nothing from the server this long gives up (30s, 2min).",
    ),
    max_connections: str = typer.Option(str(_D.max_connections), "--max-connections", help="Connections served at once; more are refused."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log jobs attaching and leaving, and each epoch."),
) -> None:
    """Serve a dataset to this user's jobs on this machine: each reservoir is read once, each job gets its own uniform order."""
    setup_logging(verbose)
    options = ServeOptions.parse(
        source="cli", tiers=tiers, ram_size=ram_size, ssd_size=ssd_size, ssd_dir=ssd_dir,
        seed=seed, epochs=epochs, slots=slots, wait_for=wait_for, lease_seconds=lease,
        max_connections=max_connections,
    )  # fmt: skip

    def ready(server: TierServer) -> None:
        what = server.path if server.mixture is None else server.mixture.describe()
        echo_err(
            f"serving {what} as {server.name!r} (pid {server.info.pid if server.info else '?'}): {server.slots} "
            f"slots of {server.slot_records} records in shared memory; attach with SharedSampler({server.name!r}, ...)"
        )

    dataset = source_of(paths, weights, epoch_size, source="cli")
    server = run_server(dataset, name=name, ready=ready, options=options)
    st = server.stats
    echo_out(
        f"served {server.epochs_served} epochs, {server.published} reservoir blocks; disk {human_bytes(st.disk.bytes_read)} "
        f"read in {st.disk.read_calls} calls"
    )

