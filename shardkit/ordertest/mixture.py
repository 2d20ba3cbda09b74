"""Order tests for a mixture of datasets: ``[epochs, L, 2]`` (dataset index, record key) per slot.

:func:`run_mixture` tests exact counts, a uniform arrangement of the slots and each dataset's own
uniformity, with exact nulls (docs/design.md §12, §15).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats as _stats

from shardkit.errors import ConfigError, InputFileError
from shardkit.ordertest import stats as st
from shardkit.ordertest.battery import MIN_EXPECTED, run
from shardkit.ordertest.keys import MAX_ELEMENTS, ArrayOrPath, load_npy
from shardkit.ordertest.report import Report, Result, Verdict, find_result, format_p
from shardkit.ordertest.settings import DEFAULTS

__all__ = ["MixtureReport", "prepare_mixture", "run_mixture", "arrangement_table_test", "equal_neighbours_moments"]


def arrangement_table_test(
    observed: np.ndarray, rows: np.ndarray, cols: np.ndarray, length: int
) -> tuple[float, np.ndarray, np.ndarray]:
    """Pearson statistic ``X2`` of a table summed over independent uniform arrangements, the weights
    ``w`` of the ``sum w_j chi2(1)`` it follows under the null, and the expected table.

    ``observed`` ``[m, c]`` counts; ``rows`` ``[E, m]`` and ``cols`` ``[E, c]`` each arrangement's margins,
    each summing to ``length`` L. Given margins, one arrangement (a uniform permutation matrix) has
    ``Cov(O_ib, O_jc) = (r_i d_ij - r_i r_j / L)(c_b d_bc - c_b c_c / L) / (L - 1)``; epochs add, and the
    weights are the eigenvalues of the standardised covariance. Equal counts in every epoch give the
    familiar ``X2 (L-1)/L ~ chi2((m-1)(C-1))``; counts that drift between epochs show in the weights.
    """
    r = np.asarray(rows, dtype=np.float64)
    c = np.asarray(cols, dtype=np.float64)
    big_l = float(length)
    expected = r.T @ c / big_l
    a = np.einsum("ei,ij->eij", r, np.eye(r.shape[1])) - np.einsum("ei,ej->eij", r, r) / big_l
    b = np.einsum("ei,ij->eij", c, np.eye(c.shape[1])) - np.einsum("ei,ej->eij", c, c) / big_l
    m, k = r.shape[1], c.shape[1]
    cov = np.einsum("eij,ekl->ikjl", a, b).reshape(m * k, m * k) / (big_l - 1)
    exp = expected.reshape(-1)
    live = exp > 0
    scale = 1.0 / np.sqrt(exp[live])
    sub = cov[np.ix_(live, live)] * scale[:, None] * scale[None, :]
    weights = np.clip(np.linalg.eigvalsh((sub + sub.T) / 2), 0.0, None)
    x2, _ = st.pearson(observed, expected)
    return x2, weights, expected


def equal_neighbours_moments(counts: np.ndarray) -> tuple[float, float]:
    """Exact mean and variance of the number of adjacent slots holding the same dataset in a uniformly
    random arrangement of a multiset with ``counts``: the same-bin pair count of the whole arrangement
    (:func:`shardkit.ordertest.stats.same_bin_pair_moments`)."""
    n = np.asarray(counts, dtype=np.float64)
    mean, var = st.same_bin_pair_moments(n, int(n.sum()))
    return mean, max(var, 0.0)


def prepare_mixture(
    pairs: ArrayOrPath, sizes: Sequence[int] | None = None
) -> tuple[np.ndarray, tuple[int, ...], str, list[str]]:
    """Validate ``[epochs, L, 2]`` (dataset index, record key) integers.

    Returns the array (int64, epochs cut short by ``--limit`` dropped), the dataset sizes (given,
    or the largest key + 1 of each dataset, noted), the source name and notes.
    """
    if isinstance(pairs, np.ndarray):
        arr, name = pairs, "pairs"
        if arr.dtype.kind not in "iu" or arr.dtype.hasobject:
            raise ConfigError(f"pairs: expected integers, found dtype {arr.dtype}")
        if arr.size > MAX_ELEMENTS:
            raise ConfigError(f"pairs: {arr.size} elements, at most {MAX_ELEMENTS} are tested")
    else:
        arr, name = load_npy(pairs, kinds="iu"), str(pairs)
    if arr.ndim != 3 or arr.shape[2] != 2:
        raise InputFileError(name, f"expected a mixture's order [epochs, L, 2] (dataset index, record key), found shape {arr.shape}")
    if arr.shape[0] < 1 or arr.shape[1] < 2:
        raise InputFileError(name, f"expected at least one epoch of at least 2 slots, found shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 1 << 63:
        raise InputFileError(name, f"value {int(arr.max())} does not fit in int64")
    arr = arr.astype(np.int64)
    notes: list[str] = []
    cut = (arr < 0).any(axis=(1, 2))
    if cut.any():
        if (arr[arr < 0] != -1).any():
            raise InputFileError(name, "negative dataset index or key: only -1 padding of an epoch cut short is allowed")
        if cut.all():
            raise InputFileError(name, "every epoch is cut short (-1 padding): nothing complete to test")
        notes.append(f"dropped {int(cut.sum())} epoch(s) cut short (-1 padding, e.g. shardkit sample --limit)")
        arr = arr[~cut]
    ds, keys = arr[..., 0], arr[..., 1]
    m = int(ds.max()) + 1 if sizes is None else len(sizes)
    if int(ds.max()) >= m:
        raise InputFileError(name, f"dataset index {int(ds.max())} is outside 0..{m - 1} ({m} dataset sizes given)")
    top = np.full(m, -1, dtype=np.int64)
    np.maximum.at(top, ds.reshape(-1), keys.reshape(-1))
    if sizes is None:
        sizes_t = tuple(int(t) + 1 for t in top)
        notes.append(f"dataset sizes {list(sizes_t)} taken from the largest key + 1 of each; give the sizes if larger")
    else:
        sizes_t = tuple(int(s) for s in sizes)
        for i, (t, s) in enumerate(zip(top, sizes_t)):
            if t >= s:
                raise InputFileError(name, f"dataset {i}: key {int(t)} is outside 0..{s - 1} (its size is {s})")
    if min(sizes_t) < 1:
        raise InputFileError(name, f"dataset {sizes_t.index(min(sizes_t))} never appears; give the dataset sizes")
    return arr, sizes_t, name, notes


@dataclass(frozen=True, eq=False)
class MixtureReport:
    """What :func:`run_mixture` found: the mixture-level results and one battery report per dataset."""

    source: str
    epochs: int
    length: int
    sizes: tuple[int, ...]
    counts: np.ndarray
    alpha: float
    results: tuple[Result, ...]
    datasets: tuple[Report | None, ...]
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not any(r.verdict == "fail" for r in self.results) and all(d is None or d.passed for d in self.datasets)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    @property
    def failed(self) -> tuple[str, ...]:
        names = [r.name for r in self.results if r.verdict == "fail"]
        for i, d in enumerate(self.datasets):
            if d is not None:
                names += [f"dataset {i}: {r.name}" for r in d.failed]
        return tuple(names)

    def result(self, name: str) -> Result:
        """The result of test ``name`` (KeyError if there is no such test)."""
        return find_result(self.results, name)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "epochs": self.epochs, "slots_per_epoch": self.length, "sizes": list(self.sizes),
                "counts_min": self.counts.min(axis=0).tolist(), "counts_max": self.counts.max(axis=0).tolist(),
                "alpha": self.alpha, "passed": self.passed, "tests": [r.to_dict() for r in self.results],
                "datasets": [None if d is None else d.to_dict() for d in self.datasets], "notes": list(self.notes)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format(self) -> str:
        """A header, one line per mixture-level test, each dataset's battery, and a verdict line."""
        lines = [f"{self.source}: {self.epochs} epoch(s) x {self.length} slots from {len(self.sizes)} datasets of "
                 f"{', '.join(map(str, self.sizes))} records; alpha = {self.alpha:g}"]
        width = max(len(r.name) for r in self.results)
        for r in self.results:
            if r.verdict == "n/a":
                lines.append(f"{r.name:<{width}}  n/a   {r.detail}")
                continue
            stat = "-" if r.statistic is None else f"{r.statistic:.4g}"
            lines.append(f"{r.name:<{width}}  {r.verdict.upper():<4}  stat {stat:<10} {r.null:<34} "
                         f"p {format_p(r.pvalue):<9} | {r.detail}")
        for i, d in enumerate(self.datasets):
            if d is None:
                lines.append(f"-- dataset {i}: fewer than 2 records in some epoch, its order is not tested")
                continue
            body = d.format().splitlines()
            lines.append(f"-- dataset {i}: " + body[0])
            lines += ["   " + x for x in body[1:]]
        lines += [f"note: {n}" for n in self.notes]
        if self.passed:
            lines.append(f"PASS: no test rejects the mixture's promise at alpha = {self.alpha:g}")
        else:
            lines.append(f"FAIL: {', '.join(self.failed)} at alpha = {self.alpha:g}")
        return "\n".join(lines)


def _result(name: str, question: str, epochs: int, *, statistic: float | None, null: str, pvalue: float | None,
            detail: str, alpha: float, verdict: Verdict | None = None, dof: float | None = None) -> Result:
    if verdict is None:
        verdict = "n/a" if pvalue is None else ("pass" if pvalue >= alpha else "fail")
    return Result(name=name, question=question, statistic=statistic, null=null, dof=dof, null_draws=None,
                  pvalue=pvalue, verdict=verdict, detail=detail, epochs=epochs, epochs_needed=None, alternative="-")


def _null_text(weights: np.ndarray) -> tuple[str, float]:
    w = weights[weights > 1e-12]
    dof = float(w.size)
    if w.size and float(w.min()) >= float(w.max()) * (1 - 1e-6):
        return f"chi2({w.size}) x {float(w.mean()):.4g}", dof
    return f"sum of {w.size} weighted chi2(1), exact cov.", dof


def _counts_result(counts: np.ndarray, target: tuple[int, ...] | None, alpha: float) -> Result:
    lo, hi = counts.min(axis=0), counts.max(axis=0)
    spread = int((hi - lo).max())
    if target is not None:
        off = int(np.abs(counts - np.array(target)[None, :]).max())
        detail = "; ".join(f"dataset {i}: {a}..{b} (target {t})" for i, (a, b, t) in enumerate(zip(lo, hi, target)))
        verdict: Verdict = "pass" if off == 0 else "fail"
        stat, null = float(off), "largest |n_ie - target_i| == 0"
    else:
        detail = "; ".join(f"dataset {i}: {a}..{b}" for i, (a, b) in enumerate(zip(lo, hi)))
        verdict = "pass" if spread == 0 else "fail"
        stat, null = float(spread), "largest spread across epochs == 0"
    return _result("counts", "does every epoch hold the same records per dataset?", counts.shape[0], statistic=stat,
                   null=null, pvalue=None, detail=detail, alpha=alpha, verdict=verdict)


def _positions_result(ds: np.ndarray, counts: np.ndarray, bins: int, alpha: float) -> Result:
    name, question = "slot_positions", "is every dataset equally likely at every slot?"
    epochs, length = ds.shape
    totals = counts.sum(axis=0)
    low = float(totals[totals > 0].min())
    c_bins = next((b for b in range(min(bins, length), 1, -1) if low * float(st.bin_sizes(length, b).min()) / length
                   >= MIN_EXPECTED), None)
    if c_bins is None:
        return _result(name, question, epochs, statistic=None, null="-", pvalue=None, alpha=alpha,
                       detail="too few epochs for 5 expected records per dataset and slot bin")
    pos = st.bin_index(np.arange(length), length, c_bins)
    table = np.zeros((counts.shape[1], c_bins))
    np.add.at(table, (ds, np.broadcast_to(pos, ds.shape)), 1)
    h = np.broadcast_to(st.bin_sizes(length, c_bins), (epochs, c_bins))
    x2, weights, _ = arrangement_table_test(table, counts, h, length)
    null, dof = _null_text(weights)
    return _result(name, question, epochs, statistic=x2, null=null, pvalue=st.weighted_chi2_sf(x2, weights), dof=dof,
                   alpha=alpha, detail=f"{counts.shape[1]} datasets x {c_bins} slot bins")


def _runs_result(ds: np.ndarray, counts: np.ndarray, alpha: float) -> Result:
    name, question = "slot_runs", "are neighbouring slots from one dataset as often as chance says?"
    same = (ds[:, 1:] == ds[:, :-1]).sum(axis=1)
    moments = np.array([equal_neighbours_moments(c) for c in counts])
    mean, var = float(moments[:, 0].sum()), float(moments[:, 1].sum())
    if var <= 0:
        return _result(name, question, ds.shape[0], statistic=None, null="-", pvalue=None, alpha=alpha,
                       detail="one dataset fills every slot: nothing to arrange")
    z = (float(same.sum()) - mean) / math.sqrt(var)
    return _result(name, question, ds.shape[0], statistic=z, null="normal (exact mean, variance)",
                   pvalue=float(2 * _stats.norm.sf(abs(z))), alpha=alpha,
                   detail=f"{int(same.sum())} equal neighbours, expected {mean:.1f}")


def _independence_result(ds: np.ndarray, counts: np.ndarray, alpha: float) -> Result:
    name, question = "slot_independence", "is a slot's dataset unrelated to the previous epoch's?"
    epochs, m = ds.shape[0], counts.shape[1]
    if epochs < 2:
        return _result(name, question, epochs, statistic=None, null="-", pvalue=None, alpha=alpha,
                       detail="needs at least 2 epochs")
    first, second = np.arange(0, epochs - 1, 2), np.arange(1, epochs, 2)  # disjoint pairs: independent tables
    table = np.zeros((m, m))
    np.add.at(table, (ds[first], ds[second]), 1)
    x2, weights, expected = arrangement_table_test(table, counts[first], counts[second], ds.shape[1])
    live = expected[expected > 0]
    if live.size == 0 or float(live.min()) < MIN_EXPECTED:
        return _result(name, question, epochs, statistic=None, null="-", pvalue=None, alpha=alpha,
                       detail="too few epochs for 5 expected slots per pair of datasets")
    null, dof = _null_text(weights)
    return _result(name, question, epochs, statistic=x2, null=null, pvalue=st.weighted_chi2_sf(x2, weights), dof=dof,
                   alpha=alpha, detail=f"{first.size} pairs of consecutive epochs")


def _balance_result(ds: np.ndarray, keys: np.ndarray, sizes: tuple[int, ...], alpha: float) -> Result:
    """Walks: after every epoch the records of each dataset were used equally often, +-1."""
    name, question = "walk_balance", "is every record used once before any is used twice?"
    worst: list[str] = []
    spread_max = 0
    for i, n in enumerate(sizes):
        uses = np.zeros(n, dtype=np.int64)
        spread = 0
        for e in range(ds.shape[0]):
            uses += np.bincount(keys[e][ds[e] == i], minlength=n)
            spread = max(spread, int(uses.max() - uses.min()))
        spread_max = max(spread_max, spread)
        worst.append(f"dataset {i}: {spread}")
    verdict: Verdict = "pass" if spread_max <= 1 else "fail"
    return _result(name, question, ds.shape[0], statistic=float(spread_max), null="max - min uses after an epoch <= 1",
                   pvalue=None, alpha=alpha, verdict=verdict, detail="; ".join(worst))


def _walk_aware(report: Report) -> Report:
    """A dataset sampled below its size walks through its records (every record once before any
    twice), so which records an epoch holds depends on the previous epoch by design: the battery's
    ``epoch_independence`` (which counts "absent" as a position) does not apply; ``walk_balance``
    tests the walks, and the positions within an epoch are tested by ``item_position``."""
    out = []
    for r in report.results:
        if r.name == "epoch_independence" and r.verdict != "n/a":
            r = dataclasses.replace(r, statistic=None, null="-", dof=None, pvalue=None, verdict="n/a",
                                    detail="a sub-sampled dataset's epochs are dependent by design (walks: every record "
                                           "once before any twice); see walk_balance")
        out.append(r)
    return dataclasses.replace(report, results=tuple(out))


def run_mixture(
    pairs: ArrayOrPath,
    *,
    sizes: Sequence[int] | None = None,
    weights: Sequence[object] | None = None,
    alpha: float = DEFAULTS.alpha,
    seed: int = DEFAULTS.seed,
    bins: int = DEFAULTS.bins,
    compute_power: bool = DEFAULTS.compute_power,
) -> MixtureReport:
    """Test a mixture's order: the **counts** per epoch (the largest-remainder rounding of ``weights``
    when given, else equal across epochs), the **slots** (``slot_positions``, ``slot_runs``,
    ``slot_independence``, ``walk_balance``) and **each dataset** (the battery on its records in
    emitted order, rows cut to the fewest any epoch has; docs/design.md §15).

    Parameters
    ----------
    pairs
        ``[epochs, L, 2]`` integers (dataset index, record key), or a ``.npy`` file of them.
    sizes
        Records per dataset (default: the largest key + 1 of each).
    weights
        The mixture's weights (see :func:`shardkit.order.mixture.epoch_counts`).
    alpha, seed, bins, compute_power
        As for :func:`shardkit.ordertest.run` (each dataset's battery).
    """
    from shardkit.order.mixture import epoch_counts

    arr, sizes_t, source, notes = prepare_mixture(pairs, sizes)
    ds, keys = arr[..., 0], arr[..., 1]
    epochs, length = ds.shape
    m = len(sizes_t)
    counts = np.stack([np.bincount(row, minlength=m) for row in ds])
    target = None
    if weights is not None:
        if len(weights) != m:
            raise ConfigError(f"weights: expected one weight per dataset ({m}), found {len(weights)}")
        target = epoch_counts(weights, length)
    results = (
        _counts_result(counts, target, alpha),
        _positions_result(ds, counts, bins, alpha),
        _runs_result(ds, counts, alpha),
        _independence_result(ds, counts, alpha),
        _balance_result(ds, keys, sizes_t, alpha),
    )
    reports: list[Report | None] = []
    for i in range(m):
        k = int(counts[:, i].min())
        if k < 2:
            reports.append(None)
            continue
        rows = np.stack([keys[e][ds[e] == i][:k] for e in range(epochs)])
        if int(counts[:, i].max()) > k:
            notes.append(f"dataset {i}: its epochs hold {k}..{int(counts[:, i].max())} records; its battery uses the first {k}")
        report = run(rows, records=sizes_t[i], alpha=alpha, seed=seed, bins=bins, compute_power=compute_power)
        reports.append(_walk_aware(report) if k < sizes_t[i] else report)
    return MixtureReport(source=source, epochs=epochs, length=length, sizes=sizes_t, counts=counts, alpha=alpha,
                         results=results, datasets=tuple(reports), notes=tuple(notes))
