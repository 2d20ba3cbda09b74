"""What ``shardkit profile`` shows: the text report, the JSON document and the plot (matplotlib,
the ``viz`` extra, imported only when a plot is written)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shardkit._extras import import_extra
from shardkit.profiling.model import Prediction
from shardkit.profiling.profiler import Profile
from shardkit.units import human_bytes

__all__ = ["report_lines", "to_json", "plot"]

_STAGE_NAMES = {"disk": "storage reads", "disk_cpu": "  of which CPU", "ssd_cpu": "  of which CPU",
                "ssd_fill": "storage -> SSD", "ssd": "SSD reads",
                "assembly": "batch assembly", "handover": "hand-over"}  # fmt: skip


def _mbps(bps: float | None) -> str:
    return "not measured" if bps is None else f"{bps / 2**20:,.1f} MiB/s"


def _row(p: Prediction) -> str:
    first, steady = p.epochs[0], p.steady
    return (f"{p.scenario.label[:34]:<34} {p.cache_fraction:>6.0%} {first.seconds:>9.3f} {steady.seconds:>9.3f} "
            f"{p.stall_fraction:>7.1%}  {steady.bottleneck}")  # fmt: skip


def report_lines(prof: Profile) -> list[str]:
    """The report ``shardkit profile`` prints: phases, where the time goes, rates, predictions, advice."""
    w, r = prof.workload, prof.rates
    lines = [
        f"dataset      {prof.path}: {w.num_records} records of {human_bytes(w.record_nbytes)} "
        f"({human_bytes(w.dataset_bytes)}), batches of {w.batch_size}, {w.epochs} epochs, step {prof.step_name}",
        "",
        f"{'phase':<34} {'seconds':>8} {'records/s':>10} {'stall':>7}  epochs (s)",
    ]
    for ph in prof.phases.values():
        epochs = " ".join(f"{s:.3f}" for s in ph.epoch_seconds)
        lines.append(f"{ph.name[:34]:<34} {ph.seconds:>8.3f} {ph.records_per_s:>10,.0f} {ph.stall_fraction:>7.1%}  {epochs}")
    lines += _storage_lines(prof)
    compute_rate = w.batch_size / r.step_s if r.step_s > 0 else float("inf")
    both = prof.phases["both"]
    lines += [
        "",
        f"step rate    {compute_rate:,.0f} records/s ({r.step_s * 1e3:.2f} ms a step, {r.step_cpu_s * 1e3:.2f} ms CPU)",
        f"ingestion    {prof.phases['ingest-warm'].records_per_s:,.0f} records/s warm, "
        f"{prof.phases['ingest-cold'].records_per_s:,.0f} records/s cold",
        f"stall        {both.stall_seconds:.3f} s of {both.seconds:.3f} s ({both.stall_fraction:.1%}) with both",
        "where the time goes (busy seconds of each stage, run with both):",
    ]
    for stage, seconds in both.busy.items():
        lines.append(f"  {_STAGE_NAMES.get(stage, stage):<16} {seconds:8.3f} s")
    lines.append(f"  {'training step':<16} {both.step_seconds:8.3f} s")
    lines += [
        "rates        storage "
        + _mbps(r.storage_bps)
        + (", page cache " + _mbps(r.page_cache_bps) + " per CPU second" if not prof.remote else "")
        + (", a warm epoch's reads " + _mbps(r.warm_bps) if r.warm_bps else "")
        + (", static cache's pages mapped " + _mbps(r.fill_bps) if r.fill_bps else "")
        + f", RAM copies {_mbps(r.copy_bps)}, SSD write {_mbps(r.ssd_write_bps)}, SSD read {_mbps(r.ssd_read_bps)}",
        f"             start {r.start_s * 1e3:.1f} ms, assembly {r.assembly_s * 1e3:.3f} ms/batch, "
        f"hand-over {r.handover_s * 1e3:.3f} ms/batch, "
        f"{r.cores} cores" + (f" ({r.parallel:.2f} threads at once)" if r.parallel is not None else "")
        + f", page cache up to {human_bytes(r.page_cache_bytes)}",
        "",
        f"{'predicted':<34} {'cache':>6} {'epoch 0':>9} {'steady':>9} {'stall':>7}  bottleneck",
    ]
    lines += [_row(p) for p in prof.whatifs]
    lines += ["", f"measured run {both.seconds:.3f} s, predicted {prof.measured.seconds:.3f} s "
              f"({_err(prof.measured.seconds, both.seconds)})"]  # fmt: skip
    if prof.checks:
        lines += ["", f"{'check':<34} {'predicted':>9} {'measured':>9} {'error':>7}  stall pred/meas"]
        for c in prof.checks:
            lines.append(f"{c.prediction.scenario.label[:34]:<34} {c.prediction.seconds:>9.3f} {c.measured.seconds:>9.3f} "
                         f"{c.error:>+7.1%}  {c.prediction.stall_fraction:.1%} / {c.measured.stall_fraction:.1%}")  # fmt: skip
    lines += ["", "advice       " + prof.advice.sentence()]
    return lines


def _storage_lines(prof: Profile) -> list[str]:
    """Bytes and requests (read calls) each phase fetched from storage per epoch, and their ratio to
    the dataset's bytes: over 1x is over-fetch (gaps read, indexes), under it a cache at work."""
    calls = "requests" if prof.remote else "calls"
    lines = ["", f"storage per epoch (bytes, {calls}, x the dataset's {human_bytes(prof.workload.dataset_bytes)}):"]
    for ph in prof.phases.values():
        per = ", ".join(f"{human_bytes(b)} in {c} {calls} ({b / max(1, prof.workload.dataset_bytes):.2f}x)"
                        for b, c in zip(ph.epoch_storage_bytes, ph.epoch_storage_calls))
        lines.append(f"  {ph.name[:32]:<32} {per or 'nothing read'}")
        if ph.download_parts:
            lines.append(f"  {'':<32} of which {human_bytes(ph.download_bytes)} downloaded into the local cache in "
                         f"{ph.download_parts} parts; readers waited {ph.download_wait_seconds:.2f} s for them")
    return lines


def _err(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}" if measured > 0 else "n/a"


def _prediction(p: Prediction) -> dict[str, Any]:
    return {
        "label": p.scenario.label, "workers": p.scenario.workers, "ram_bytes": int(p.sizes.ram_bytes),
        "static_records": int(p.sizes.static_records), "cache_fraction": p.cache_fraction,
        "ssd_bytes": None if p.sizes.ssd_bytes is None else int(p.sizes.ssd_bytes),
        "storage_bps": p.scenario.storage_bps, "seconds": p.seconds,
        "stall_seconds": p.stall_seconds, "stall_fraction": p.stall_fraction,
        "epochs": [{"seconds": e.seconds, "stall_seconds": e.stall_seconds, "storage_bytes": e.storage_bytes,
                    "startup_seconds": e.startup_seconds, "stages": dict(e.stages), "bottleneck": e.bottleneck}
                   for e in p.epochs],
    }  # fmt: skip


def _plain(value: Any) -> Any:
    """``value`` with numpy scalars turned into Python numbers (what :mod:`json` accepts)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def to_json(prof: Profile) -> dict[str, Any]:
    """The profile as a JSON-able document (``shardkit profile --json``)."""
    w, r = prof.workload, prof.rates
    doc = {
        "path": prof.path,
        "workload": {"num_records": w.num_records, "record_nbytes": w.record_nbytes, "batch_size": w.batch_size,
                     "epochs": w.epochs, "dataset_bytes": w.dataset_bytes},
        "step": prof.step_name,
        "phases": {name: ph.as_dict() for name, ph in prof.phases.items()},
        "rates": {k: getattr(r, k) for k in r.__dataclass_fields__},
        "measured": _prediction(prof.measured),
        "whatifs": [_prediction(p) for p in prof.whatifs],
        "checks": [{"prediction": _prediction(c.prediction), "measured": c.measured.as_dict(), "error": c.error,
                    "rates": None if c.rates is None else {k: getattr(c.rates, k) for k in c.rates.__dataclass_fields__}}
                   for c in prof.checks],
        "advice": {"bottleneck": prof.advice.bottleneck, "stall_fraction": prof.advice.stall_fraction,
                   "change": prof.advice.change, "sentence": prof.advice.sentence()},
    }  # fmt: skip
    result: dict[str, Any] = _plain(doc)
    return result


def plot(prof: Profile, out: Path) -> Path:
    """Write a PNG of predicted epoch time against the static cache's size (the measured
    configuration and the checked ones marked by what they measured)."""
    import_extra("matplotlib", "viz", needed_by="shardkit profile --plot")
    from matplotlib.figure import Figure

    fig: Any = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    mib = 2**20
    curve = prof.curve
    xs = [p.sizes.cache_bytes / mib for p in curve]
    ax.plot(xs, [p.steady.seconds for p in curve], "-", label="predicted, steady epoch")
    ax.plot(xs, [p.epochs[0].seconds for p in curve], "--", label="predicted, first epoch")
    compute = prof.measured.steady.stages.get("compute", 0.0)
    ax.axhline(compute, color="grey", lw=0.8, ls=":", label="training step alone")
    both = prof.phases["both"]
    ax.plot([prof.measured.sizes.cache_bytes / mib], [both.epoch_seconds[-1]], "o", color="black", label="measured")
    for c in prof.checks:
        ax.plot([c.prediction.sizes.cache_bytes / mib], [c.measured.epoch_seconds[-1]], "s", color="tab:red")
    if prof.checks:
        ax.plot([], [], "s", color="tab:red", label="checked configurations")
    ax.set_xlabel("static cache (MiB; dataset %.0f MiB)" % (prof.workload.dataset_bytes / mib))
    ax.set_ylabel("epoch time (s)")
    ax.set_title(f"shardkit profile: {Path(prof.path).name}")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
