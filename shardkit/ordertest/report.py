"""The battery's results: one frozen :class:`Result` per test, gathered in a :class:`Report`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = ["Result", "Report", "Verdict", "format_p", "find_result"]

Verdict = Literal["pass", "fail", "n/a"]


def format_p(p: float | None) -> str:
    """``0.37``, ``3.1e-05`` or ``< 1e-300``: a p-value for people."""
    if p is None:
        return "-"
    if p <= 1e-300:
        return "< 1e-300"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


@dataclass(frozen=True)
class Result:
    """One test of the battery.

    Attributes
    ----------
    name, question
        Stable identifier (``item_position``, ...; also the JSON key) and what the test asks.
    statistic, null, dof
        The test statistic (None when the test does not apply), its null distribution as printed
        (``chi2(225)``, ``t(499), simulated null: 500 draws``, ...), and the (effective) degrees of
        freedom of a chi-square null.
    null_draws
        Simulated epochs behind the null, when part of it is simulated.
    pvalue, verdict
        Upper-tail (chi-square) or two-sided (z, t) p-value; ``pass`` (p >= alpha), ``fail`` or ``n/a``.
    detail
        Observed vs expected values, binning, or why the test does not apply.
    epochs, epochs_needed, alternative
        Epochs in the input; the fewest for the stated power against the reference ``alternative``
        and for the null's approximation (None when no number of epochs reaches it).
    residuals
        Standardised residuals of the test's table, for plots (not in JSON).
    """

    name: str
    question: str
    statistic: float | None
    null: str
    dof: float | None
    null_draws: int | None
    pvalue: float | None
    verdict: Verdict
    detail: str
    epochs: int
    epochs_needed: int | None
    alternative: str
    residuals: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def enough(self) -> bool:
        """The input has at least :attr:`epochs_needed` epochs."""
        return self.epochs_needed is not None and self.epochs >= self.epochs_needed

    def to_dict(self) -> dict[str, Any]:
        def num(x: float | None) -> float | None:
            return None if x is None or not math.isfinite(x) else float(x)

        return {"name": self.name, "question": self.question, "statistic": num(self.statistic),
                "null": self.null, "dof": num(self.dof), "null_draws": self.null_draws,
                "pvalue": num(self.pvalue), "verdict": self.verdict, "detail": self.detail,
                "epochs": self.epochs, "epochs_needed": self.epochs_needed, "enough_epochs": self.enough,
                "alternative": self.alternative}


def find_result(results: tuple[Result, ...] | list[Result], name: str) -> Result:
    """The result of test ``name`` among ``results`` (KeyError naming the tests there are)."""
    for r in results:
        if r.name == name:
            return r
    raise KeyError(f"no test named {name!r}; tests: {', '.join(r.name for r in results)}")


@dataclass(frozen=True)
class Report:
    """Everything :func:`shardkit.ordertest.run` found; ``passed`` when no test failed at ``alpha``
    (``n/a`` is no failure), ``exit_code`` 0 if so, else 1."""

    source: str
    kind: str
    records: int
    epochs: int
    length: int
    alpha: float
    power: float
    seed: int
    results: tuple[Result, ...]
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not any(r.verdict == "fail" for r in self.results)

    @property
    def tested(self) -> tuple[Result, ...]:
        """Results with a verdict (the tests that applied)."""
        return tuple(r for r in self.results if r.verdict != "n/a")

    @property
    def failed(self) -> tuple[Result, ...]:
        return tuple(r for r in self.results if r.verdict == "fail")

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def result(self, name: str) -> Result:
        """The result of test ``name`` (KeyError if the battery has no such test)."""
        return find_result(self.results, name)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "kind": self.kind, "records": self.records, "epochs": self.epochs,
                "keys_per_epoch": self.length, "alpha": self.alpha, "power": self.power, "seed": self.seed,
                "passed": self.passed, "tests": [r.to_dict() for r in self.results], "notes": list(self.notes)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format(self) -> str:
        """One header line, one line per test, the notes, and a verdict line."""
        what = {"permutation": "a permutation of 0..N-1 per row", "distinct": "distinct keys per row (k < N)",
                "repeats": "rows with repeated keys"}[self.kind]
        lines = [f"{self.source}: {self.epochs} epoch(s) x {self.length} keys, N = {self.records} records, "
                 f"{what}; alpha = {self.alpha:g}, power {self.power:.0%}"]
        width = max(len(r.name) for r in self.results) if self.results else 10
        for r in self.results:
            lines.append(_line(r, width, self.power))
        lines += [f"note: {n}" for n in self.notes]
        if not self.tested:
            lines.append("no test applies to this input")
        elif self.passed:
            lines.append(f"PASS: {len(self.tested)} test(s) find no departure from a uniform order at alpha = "
                         f"{self.alpha:g}")
        else:
            lines.append(f"FAIL: {', '.join(r.name for r in self.failed)} reject a uniform order at alpha = "
                         f"{self.alpha:g}")
        return "\n".join(lines)


def _line(r: Result, width: int, power: float) -> str:
    if r.verdict == "n/a":
        return f"{r.name:<{width}}  n/a   {r.detail}"
    stat = f"{r.statistic:.4g}" if r.statistic is not None else "-"
    if r.epochs_needed is None:
        need = f"no epoch count gives {power:.0%} power vs {r.alternative}"
    else:
        need = (f"needs >= {r.epochs_needed} epochs for {power:.0%} power vs {r.alternative}: "
                f"{'has' if r.enough else 'has only'} {r.epochs}")
    return (f"{r.name:<{width}}  {r.verdict.upper():<4}  stat {stat:<10} {r.null:<40} p {format_p(r.pvalue):<9} "
            f"| {r.detail} | {need}")
