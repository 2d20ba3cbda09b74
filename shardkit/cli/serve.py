"""``shardkit serve``: one tier stack on this machine that concurrent training jobs attach to by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from shardkit.cli.app import app, echo_err, setup_logging
from shardkit.readers.server import serve as run_server


@app.command()
def serve(
    path: str = typer.Argument(..., help="Dataset directory or URL (s3://bucket/ds, gs://, az://, http(s)://)."),
    name: str = typer.Option("default", "--name", help="Name jobs attach to: SharedSampler(NAME) or shared=NAME."),
    tiers: str = typer.Option("ram", "--tiers", help="'ram' or 'ram,ssd'."),
    ram_size: str = typer.Option(
        "512MiB", "--ram-size",
        help="The shared-memory ring: --slots slots of ram-size/slots each (bytes like 2GiB, or 10000records).",
    ),
    ssd_size: str = typer.Option("4GiB", "--ssd-size", help="SSD-tier budget: two reservoirs of half of it."),
    ssd_dir: Path = typer.Option(None, "--ssd-dir", help="Directory for the SSD reservoirs (default: temp dir)."),
    seed: int = typer.Option(0, "--seed", help="Seeds the server's partition of every epoch into reservoirs."),
    epochs: int = typer.Option(None, "--epochs", help="Serve this many epochs, then stop (default: until SIGTERM/Ctrl-C)."),
    slots: int = typer.Option(3, "--slots", help="Ring slots (>= 2); a slow job holds the others back by at most this many reservoirs."),
    wait_for: int = typer.Option(1, "--wait-for", help="Jobs to wait for before the first epoch."),
    lease: float = typer.Option(30.0, "--lease", help="Seconds of silence after which a job is dropped."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log jobs attaching and leaving, and each epoch."),
) -> None:
    """Serve a dataset to every job on this machine: each reservoir is read once, each job gets its own uniform order."""
    setup_logging(verbose)

    def ready(server: Any) -> None:
        echo_err(
            f"serving {server.path} as {server.name!r} (pid {server.info['pid']}): {server.slots} slots of "
            f"{server.slot_records} records in shared memory; attach with SharedSampler({server.name!r}, ...)"
        )

    server = run_server(
        path, name=name, tiers=tiers, ram_size=ram_size, ssd_size=ssd_size, ssd_dir=ssd_dir, seed=seed,
        epochs=epochs, slots=slots, wait_for=wait_for, lease_seconds=lease, ready=ready,
    )
    st = server.stats
    typer.echo(
        f"served {server.epochs_served} epochs, {server.published} reservoir blocks; disk {st.disk.bytes_read / 1e6:,.1f} MB "
        f"read in {st.disk.read_calls} calls"
    )
