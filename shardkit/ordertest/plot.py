"""A picture of where an order departs from uniform: the item x position and adjacent-pair maps of
standardised residuals (how to read them: docs/design.md §15). Needs matplotlib (the ``viz`` extra);
only the object-oriented API is used, so no global pyplot state is touched."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from shardkit._extras import import_extra
from shardkit.errors import ConfigError
from shardkit.ordertest.report import Report, Result, format_p

__all__ = ["plot_report", "require_matplotlib", "FORMATS"]

#: File types the plot can be written as (by suffix).
FORMATS = (".png", ".pdf", ".svg")
_AXES = {
    "item_position": ("position bin (emitted order)", "item bin (storage order)"),
    "adjacent_pairs": ("storage bin of the key at p+1", "storage bin of the key at p"),
    "joint_positions": ("position bin of storage key s+1", "position bin of storage key s"),
}


def require_matplotlib(what: str = "shardkit.ordertest.plot") -> None:
    """Import matplotlib now, or raise :class:`~shardkit.errors.MissingExtraError` naming ``viz``."""
    import_extra("matplotlib", "viz", needed_by=what)


def _panels(report: Report) -> list[Result]:
    by_name = {r.name: r for r in report.results if r.residuals is not None}
    panels = [by_name[n] for n in ("item_position",) if n in by_name]
    pair = by_name.get("adjacent_pairs") or by_name.get("joint_positions")
    if pair is not None:
        panels.append(pair)
    if not panels and "inclusion_frequency" in by_name:
        panels.append(by_name["inclusion_frequency"])
    return panels


def _title(r: Result) -> str:
    return f"{r.name}: p {format_p(r.pvalue)} ({r.verdict.upper()})"


def plot_report(report: Report, path: str | os.PathLike[str], *, needed_by: str = "shardkit.ordertest.plot") -> Path:
    """Write the residual maps of ``report`` to ``path`` (``.png``, ``.pdf`` or ``.svg``), on a
    symmetric colour scale of at least +-3 so a failing order shows its structure."""
    out = Path(path)
    if out.suffix.lower() not in FORMATS:
        raise ConfigError(f"plot: expected a file name ending in {', '.join(FORMATS)}, found {str(out)!r}")
    require_matplotlib(needed_by)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = _panels(report)
    fig = Figure(figsize=(5.4 * max(len(panels), 1), 5.0))
    FigureCanvasAgg(fig)
    if not panels:
        ax = fig.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, "no table to show for this input", ha="center", va="center")
        ax.set_axis_off()
    for i, r in enumerate(panels, start=1):
        ax = fig.add_subplot(1, len(panels), i)
        resid = np.asarray(r.residuals, dtype=np.float64)
        limit = max(3.0, float(np.percentile(np.abs(resid), 99)))
        if resid.ndim == 1:
            ax.bar(np.arange(resid.size), resid, color=np.where(resid > 0, "#b2182b", "#2166ac"))
            ax.set_ylim(-limit, limit)
            ax.set_xlabel("storage bin")
            ax.set_ylabel("(O - E) / sqrt(E)")
        else:
            im = ax.imshow(resid, cmap="RdBu_r", vmin=-limit, vmax=limit, origin="lower", aspect="auto",
                           interpolation="nearest")
            xlabel, ylabel = _AXES.get(r.name, ("", ""))
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            fig.colorbar(im, ax=ax, shrink=0.85, label="(O - E) / sqrt(E)")
        ax.set_title(_title(r), fontsize=10)
    verdict = "no test rejects a uniform order" if report.passed else "NOT uniform, rejected by " + ", ".join(
        r.name for r in report.failed)
    fig.suptitle(f"{Path(report.source).name}: {report.epochs} epochs x {report.length} keys (N = {report.records})\n"
                 f"{verdict} (alpha = {report.alpha:g})", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
