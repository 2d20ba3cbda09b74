"""The uniformity battery: statistical tests of the order a loader emitted, each with its null and
the epochs it needs to reject a reference non-uniform order (docs/design.md §15; tests listed in :func:`run`)."""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import numpy as np
from scipy import stats as _stats

from shardkit.errors import ConfigError
from shardkit.order.seeds import Domain, check_seed, rng
from shardkit.ordertest import alternatives as alt
from shardkit.ordertest import stats as st
from shardkit.ordertest.keys import ArrayOrPath, Kind, OrderKeys, prepare
from shardkit.ordertest.report import Report, Result, Verdict
from shardkit.ordertest.settings import DEFAULTS, Settings
from shardkit.units import parse_count

__all__ = ["Settings", "BatteryTest", "BATTERY", "run", "run_prepared", "check_fraction", "MIN_EXPECTED"]

#: Smallest expected count per cell for the chi-square approximations (the classical rule of 5).
MIN_EXPECTED = 5.0
#: Element budget of one reference-alternative simulation (epochs x N); at least 4 epochs are drawn
#: (enough at large N, where one epoch of a reference order carries a huge noncentrality).
ALT_BUDGET = 2_000_000
#: Element budget of the labels test's simulated null (draws x N); at least 50 draws.
NULL_BUDGET = 20_000_000

# Random streams (part of the numbers drawn: never renumber).
_STREAM_BUFFER, _STREAM_BLOCK, _STREAM_REPEATED, _STREAM_BUFFER2 = 101, 102, 103, 104


class _Context:
    """The data, the settings, and reference alternatives shared by the tests (drawn once each)."""

    def __init__(self, data: OrderKeys, settings: Settings) -> None:
        self.data, self.settings = data, settings
        self._refs: dict[str, np.ndarray] = {}

    def rng(self, stream: int) -> np.random.Generator:
        return rng(Domain.ORDER_TEST, self.settings.seed, stream)

    def alt_epochs(self) -> int:
        return int(min(400, max(4, ALT_BUDGET // max(self.data.n, 1))))

    def reference(self, name: str) -> np.ndarray:
        """``[M, N]`` storage orders of the reference alternative ``name`` (cached)."""
        if name not in self._refs:
            n, m = self.data.n, self.alt_epochs()
            b = _reference_size(n, self.settings.effect)
            if name == "repeated":
                self._refs[name] = alt.repeated_block_orders(self.rng(_STREAM_REPEATED), n, b, m)
            else:
                stream, shuffle, size, epochs = {
                    "buffer": (_STREAM_BUFFER, alt.buffer_shuffle, b, m),
                    "block": (_STREAM_BLOCK, alt.block_shuffle, b, m),
                    "buffer2": (_STREAM_BUFFER2, alt.buffer_shuffle, 2, 4000),
                }[name]
                g = self.rng(stream)
                self._refs[name] = np.stack([shuffle(g, n, size) for _ in range(epochs)])
        return self._refs[name]

    def reference_rows(self, name: str) -> np.ndarray:
        """The reference orders cut to this input's row length (k keys; repeated epochs if k > N)."""
        full = self.reference(name)
        k = self.data.length
        if k <= full.shape[1]:
            return full[:, :k]
        reps = -(-k // full.shape[1])
        return np.concatenate([np.roll(full, -i, axis=0) for i in range(reps)], axis=1)[:, :k]


def _reference_size(n: int, effect: float) -> int:
    """Buffer / block size of the reference alternatives: ``effect * N`` records, at least 2."""
    return max(2, round(n * effect))


def _describe(name: str, n: int, effect: float) -> str:
    b = _reference_size(n, effect)
    frac = f"{effect:g} N"
    return {
        "buffer": f"a buffer shuffle of {b} records ({frac})",
        "block": f"a shuffle of storage blocks of {b} records ({frac})",
        "repeated": f"blocks of {b} records in one order repeated every epoch",
        "buffer2": "a buffer shuffle of 2 records",
        "inclusion": f"half of the keys drawn {(1 + effect) / (1 - effect):.3g}x as often as the other half",
    }[name]


def _fit_bins(cap: int, fits: Callable[[int], bool]) -> int | None:
    """Largest bin count in ``cap..2`` for which ``fits`` holds, else None."""
    return next((b for b in range(cap, 1, -1) if fits(b)), None)


def _position_bins(pb_rows: np.ndarray, k: int, n: int, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """For rows of storage positions: ``[rows, n]`` position bin of every storage position (``bins`` =
    absent when k < n) and the bin sizes (absent last)."""
    rows = pb_rows.shape[0]
    out = np.full((rows, n), bins, dtype=np.int64)
    out[np.arange(rows)[:, None], pb_rows] = st.bin_index(np.arange(k), k, bins)[None, :]
    sizes = st.bin_sizes(k, bins)
    if k < n:
        sizes = np.append(sizes, n - k)
    return out, sizes


class BatteryTest(ABC):
    """One test of the battery: applies to some kinds of rows, evaluates to a :class:`Result`."""

    name: ClassVar[str]
    question: ClassVar[str]
    kinds: ClassVar[frozenset[Kind]] = frozenset({"permutation", "distinct"})
    reference: ClassVar[str] = "buffer"

    def run(self, ctx: _Context) -> Result:
        d = ctx.data
        if d.kind not in self.kinds:
            what = {"permutation": "permutation rows", "distinct": "rows of k < N distinct keys",
                    "repeats": "rows with repeated keys"}[d.kind]
            return self.not_applicable(ctx, f"does not apply to {what}")
        return self.evaluate(ctx)

    @abstractmethod
    def evaluate(self, ctx: _Context) -> Result:
        """Compute the statistic, its p-value and the epochs needed for the stated power."""

    def alternative(self, ctx: _Context) -> str:
        return _describe(self.reference, ctx.data.n, ctx.settings.effect)

    def not_applicable(self, ctx: _Context, why: str, needed: int | None = None) -> Result:
        return Result(name=self.name, question=self.question, statistic=None, null="-", dof=None,
                      null_draws=None, pvalue=None, verdict="n/a", detail=why, epochs=ctx.data.epochs,
                      epochs_needed=needed, alternative=self.alternative(ctx))

    def result(self, ctx: _Context, *, statistic: float, null: str, pvalue: float, detail: str,
               needed: int | None, dof: float | None = None, draws: int | None = None,
               residuals: np.ndarray | None = None) -> Result:
        verdict: Verdict = "pass" if pvalue >= ctx.settings.alpha else "fail"
        return Result(name=self.name, question=self.question, statistic=float(statistic), null=null, dof=dof,
                      null_draws=draws, pvalue=float(pvalue), verdict=verdict, detail=detail,
                      epochs=ctx.data.epochs, epochs_needed=needed, alternative=self.alternative(ctx),
                      residuals=residuals)


def _needed(valid: int, power: int | None, compute_power: bool) -> int | None:
    """Epochs needed: for the approximation (``valid``) and for the power (None: never)."""
    if not compute_power:
        return valid
    return None if power is None else max(valid, power)


class ItemPosition(BatteryTest):
    name = "item_position"
    question = "is every item equally likely at every position?"

    def evaluate(self, ctx: _Context) -> Result:
        d, s = ctx.data, ctx.settings
        n, k, e = d.n, d.length, d.epochs

        def valid_epochs(b: int) -> int:
            gmin, hmin = float(st.bin_sizes(n, min(b, n)).min()), float(st.bin_sizes(k, min(b, k)).min())
            return math.ceil(MIN_EXPECTED * n / (gmin * hmin) - 1e-9)

        b = _fit_bins(min(s.bins, max(n, k)), lambda b: valid_epochs(b) <= e)
        if b is None:
            return self.not_applicable(ctx, f"needs >= {valid_epochs(2)} epochs for the chi-square approximation "
                                            f"(expected count >= {MIN_EXPECTED:g} per cell of 2 x 2 bins)",
                                       valid_epochs(2))
        r_bins, c_bins = min(b, n), min(b, k)
        table = st.position_table(d.storage, n, r_bins, c_bins)
        stat, resid = st.item_position_statistic(table, n, k, e)
        dof = (r_bins - 1) * (c_bins - 1)
        power = None
        if s.compute_power:
            power = st.epochs_for_power(self._per_epoch(ctx, r_bins, c_bins), dof, s.alpha, s.power)
        return self.result(ctx, statistic=stat, null=f"chi2({dof}), X2 (N-1)/N", dof=dof,
                           pvalue=float(_stats.chi2.sf(stat, dof)),
                           detail=f"{r_bins} item x {c_bins} position bins", residuals=resid,
                           needed=_needed(valid_epochs(b), power, s.compute_power))

    @staticmethod
    def _per_epoch(ctx: _Context, r_bins: int, c_bins: int) -> float:
        d = ctx.data
        n, k = d.n, d.length
        rows = ctx.reference_rows("buffer")
        item = st.bin_index(rows, n, r_bins) * c_bins + st.bin_index(np.arange(k), k, c_bins)[None, :]
        flat = item + (np.arange(rows.shape[0]) * r_bins * c_bins)[:, None]
        tables = np.bincount(flat.reshape(-1), minlength=rows.shape[0] * r_bins * c_bins).reshape(
            rows.shape[0], r_bins, c_bins).astype(np.float64)
        g, h = st.bin_sizes(n, r_bins), st.bin_sizes(k, c_bins)
        # Project out the item-frequency part (row sums): the statistic sees the interaction only.
        tables -= tables.sum(axis=2, keepdims=True) * (h / k)[None, None, :]
        e1 = np.outer(g, h) / n
        interaction_mean = np.zeros(r_bins * c_bins)
        flat_tables = tables.reshape(rows.shape[0], -1)
        return (n - 1) / n * st.split_half_noncentrality(flat_tables, interaction_mean, 1 / e1.reshape(-1))


class InclusionFrequency(BatteryTest):
    name = "inclusion_frequency"
    question = "is every key drawn equally often?"
    kinds = frozenset({"distinct", "repeats"})
    reference = "inclusion"

    def evaluate(self, ctx: _Context) -> Result:
        d, s = ctx.data, ctx.settings
        n, k, e = d.n, d.length, d.epochs

        def valid_epochs(b: int) -> int:
            return math.ceil(MIN_EXPECTED * n / (k * float(st.bin_sizes(n, b).min())) - 1e-9)

        b = _fit_bins(min(s.bins, n), lambda b: valid_epochs(b) <= e)
        if b is None:
            return self.not_applicable(ctx, f"needs >= {valid_epochs(2)} epochs for an expected count >= "
                                            f"{MIN_EXPECTED:g} per bin", valid_epochs(2))
        g = st.bin_sizes(n, b)
        counts = np.bincount(st.bin_index(d.storage, n, b).reshape(-1), minlength=b)
        expected = e * k * g / n
        x2, resid = st.pearson(counts, expected)
        # k distinct keys per row: each row's bin counts are multivariate hypergeometric, variance
        # (n - k) / (n - 1) of the multinomial one. Repeats: multinomial (exact for i.i.d. draws,
        # conservative for draws without replacement inside reservoirs).
        scale = (n - 1) / (n - k) if d.kind == "distinct" else 1.0
        stat, dof = x2 * scale, b - 1
        weight = np.where(np.arange(n) < n / 2, 1 + s.effect, 1 - s.effect)
        p_bins = np.bincount(st.bin_index(np.arange(n), n, b), weights=weight / weight.sum(), minlength=b)
        per_epoch = scale * k * n * float(((p_bins - g / n) ** 2 / g).sum())
        power = st.epochs_for_power(per_epoch, dof, s.alpha, s.power) if s.compute_power else None
        return self.result(ctx, statistic=stat, null=f"chi2({dof})" + (", X2 (N-1)/(N-k)" if scale != 1 else ""),
                           dof=dof, pvalue=float(_stats.chi2.sf(stat, dof)), residuals=resid,
                           detail=f"{b} storage bins" + ("; multinomial null (conservative for reservoirs)"
                                                         if d.kind == "repeats" else ""),
                           needed=_needed(valid_epochs(b), power, s.compute_power))


class _PairTableTest(BatteryTest):
    """Pearson statistic of an adjacent-pair table whose exact null covariance is known."""

    reference = "block"

    @abstractmethod
    def sizes(self, ctx: _Context, bins: int) -> tuple[np.ndarray, int]:
        """``(bin sizes, sequence length)``: each row is seen as the first ``length`` elements of a
        uniform arrangement of a multiset with these sizes."""

    @abstractmethod
    def sequences(self, ctx: _Context, rows: np.ndarray, bins: int) -> np.ndarray:
        """``[rows, length]`` bin sequences of ``rows`` of storage positions."""

    @abstractmethod
    def detail(self, bins: int) -> str:
        """How the sequence was binned."""

    def evaluate(self, ctx: _Context) -> Result:
        d, s = ctx.data, ctx.settings
        e = d.epochs

        def valid_epochs(b: int) -> int:
            mean, _ = st.pair_null(*self.sizes(ctx, b))
            return math.ceil(MIN_EXPECTED / float(mean[mean > 0].min()) - 1e-9)

        b = _fit_bins(min(s.bins, max(d.n, d.length)), lambda b: valid_epochs(b) <= e)
        if b is None:
            need = valid_epochs(2)
            return self.not_applicable(ctx, f"needs >= {need} epochs for an expected count >= {MIN_EXPECTED:g} "
                                            "per pair cell", need)
        sizes, length = self.sizes(ctx, b)
        mean, eig = st.pair_null(sizes, length)
        nb = sizes.size
        observed = st.pair_table(self.sequences(ctx, d.storage, b), nb).sum(axis=0)
        x2, resid = st.pearson(observed, e * mean)
        scale, dof = st.satterthwaite(eig)
        power = None
        if s.compute_power:
            alt_seq = self.sequences(ctx, ctx.reference_rows(self.reference), b)
            live = mean > 0
            weight = np.where(live, 1 / np.where(live, mean, 1), 0.0)
            per_epoch = st.split_half_noncentrality(st.pair_table(alt_seq, nb), mean, weight)
            power = st.epochs_for_power(per_epoch / scale, dof, s.alpha, s.power)
        return self.result(ctx, statistic=x2, null=f"sum of {eig.size} weighted chi2(1), exact cov.",
                           dof=dof, pvalue=st.weighted_chi2_sf(x2, eig), detail=self.detail(nb),
                           residuals=resid.reshape(nb, nb),
                           needed=_needed(valid_epochs(b), power, s.compute_power))


class AdjacentPairs(_PairTableTest):
    name = "adjacent_pairs"
    question = "are keys emitted next to each other unrelated in storage?"

    def sizes(self, ctx: _Context, bins: int) -> tuple[np.ndarray, int]:
        return st.bin_sizes(ctx.data.n, min(bins, ctx.data.n)), ctx.data.length

    def sequences(self, ctx: _Context, rows: np.ndarray, bins: int) -> np.ndarray:
        return st.bin_index(rows, ctx.data.n, min(bins, ctx.data.n))

    def detail(self, bins: int) -> str:
        return f"(storage bin at p, storage bin at p+1), {bins} bins"


class JointPositions(_PairTableTest):
    name = "joint_positions"
    question = "are storage neighbours emitted at unrelated positions?"

    def sizes(self, ctx: _Context, bins: int) -> tuple[np.ndarray, int]:
        n, k = ctx.data.n, ctx.data.length
        h = st.bin_sizes(k, min(bins, k))
        return (np.append(h, n - k) if k < n else h), n

    def sequences(self, ctx: _Context, rows: np.ndarray, bins: int) -> np.ndarray:
        return _position_bins(rows, rows.shape[1], ctx.data.n, min(bins, rows.shape[1]))[0]

    def detail(self, bins: int) -> str:
        return f"(position bin of storage key s, of s+1), {bins} bins"


class StorageSpearman(BatteryTest):
    name = "storage_spearman"
    question = "does the emitted order follow storage order?"
    kinds = frozenset({"permutation", "distinct", "repeats"})

    def evaluate(self, ctx: _Context) -> Result:
        d, s = ctx.data, ctx.settings
        k = d.length
        valid = math.ceil(30 / (k - 1))
        if k < 3 or d.epochs < valid:
            return self.not_applicable(ctx, f"needs E (k - 1) >= 30 for the normal approximation (k >= 3): "
                                            f">= {valid} epochs", valid)
        rho = st.row_spearman(d.storage)
        rho = rho[np.isfinite(rho)]
        if rho.size == 0:
            return self.not_applicable(ctx, "every row holds one key repeated", None)
        sd = 1 / math.sqrt(rho.size * (k - 1))
        mean = float(rho.mean())
        z = mean / sd
        power = None
        if s.compute_power:
            alt_rho = st.row_spearman(ctx.reference_rows(self.reference))
            power = st.z_epochs_for_power(float(np.nanmean(alt_rho)) * math.sqrt(k - 1), s.alpha, s.power)
        return self.result(ctx, statistic=mean, null="normal, var 1/(E (k-1))",
                           pvalue=float(2 * _stats.norm.sf(abs(z))),
                           detail=f"mean rho {mean:+.4f} (uniform: 0 +- {sd:.4f}), z = {z:+.2f}",
                           needed=_needed(valid, power, s.compute_power))


class LabelsPerBatch(BatteryTest):
    name = "labels_per_batch"
    question = "do batches mix the classes as a uniform shuffle would?"
    #: Random stream of the simulated null (never renumber).
    stream = 6

    def evaluate(self, ctx: _Context) -> Result:
        d, s = ctx.data, ctx.settings
        if d.labels is None or s.batch_size is None:
            return self.not_applicable(ctx, "needs labels (one per key) and a batch size")
        b, k, e = s.batch_size, d.length, d.epochs
        if b > k:
            return self.not_applicable(ctx, f"batch size {b} is larger than a row ({k} keys)")
        sizes = st.batch_sizes(k, b)
        valid = math.ceil(30 / len(sizes))
        if e < valid:
            return self.not_applicable(ctx, f"needs >= 30 batches in all for the t approximation: >= {valid} epochs",
                                       valid)
        counts = np.bincount(d.labels)
        expected = st.expected_distinct_labels(counts, sizes)
        observed = st.distinct_per_batch(d.labels[d.storage], b)
        draws = int(min(s.null_draws, max(50, NULL_BUDGET // d.n)))
        g = ctx.rng(self.stream)
        null = st.distinct_per_batch(np.stack([d.labels[g.permutation(d.n)[:k]] for _ in range(draws)]), b)
        var = float(null.var(ddof=1))
        mean = float(observed.mean())
        if var == 0.0:  # one class, or batches that always hold every class: no randomness to test
            z, p = 0.0, 1.0 if abs(mean - expected) < 1e-9 else 0.0
        else:
            z = (mean - expected) / math.sqrt(var / e)
            p = float(2 * _stats.t.sf(abs(z), draws - 1))
        power = None
        if s.compute_power and var > 0:
            alt_mean = float(st.distinct_per_batch(d.labels[ctx.reference_rows(self.reference)], b).mean())
            power = st.z_epochs_for_power((alt_mean - expected) / math.sqrt(var), s.alpha, s.power)
        return self.result(ctx, statistic=mean, null=f"t({draws - 1}), simulated null: {draws} draws",
                           draws=draws, pvalue=p, needed=_needed(valid, power, s.compute_power),
                           detail=f"{mean:.3f} distinct labels per batch of {b} (uniform: {expected:.3f}), "
                                  f"z = {z:+.2f}")


class EpochIndependence(BatteryTest):
    name = "epoch_independence"
    question = "is each epoch's order unrelated to the previous epoch's?"
    reference = "repeated"

    def evaluate(self, ctx: _Context) -> Result:
        d, s = ctx.data, ctx.settings
        n, k, e = d.n, d.length, d.epochs

        def sizes(b: int) -> np.ndarray:
            h = st.bin_sizes(k, min(b, k))
            return np.append(h, n - k) if k < n else h

        def valid_epochs(b: int) -> int:
            u = sizes(b)
            return 1 + math.ceil(MIN_EXPECTED * n / float(u.min()) ** 2 - 1e-9)

        b = _fit_bins(min(s.bins, k), lambda b: valid_epochs(b) <= e)
        if b is None:
            need = valid_epochs(2)
            return self.not_applicable(ctx, f"needs >= {need} epochs (pairs of consecutive epochs) for an expected "
                                            f"count >= {MIN_EXPECTED:g} per cell", need)
        u = sizes(b)
        c = u.size
        pb, _ = _position_bins(d.storage, k, n, min(b, k))
        table = self._tables(pb, c).sum(axis=0).reshape(c, c)
        expected = (e - 1) * np.outer(u, u) / n
        x2, resid = st.pearson(table, expected)
        # Consecutive epochs' tables are uncorrelated (conditional on epoch e+1 the table of (e, e+1)
        # has a constant mean), and each is the table of two independent partitions with fixed
        # margins, covariance (n/(n-1)) x projection: the item x position argument again.
        stat, dof = x2 * (n - 1) / n, (c - 1) ** 2
        power = None
        if s.compute_power:
            alt_pb, _ = _position_bins(ctx.reference_rows(self.reference), k, n, min(b, k))
            mean1 = (np.outer(u, u) / n).reshape(-1)
            per_epoch = (n - 1) / n * st.split_half_noncentrality(self._tables(alt_pb, c), mean1, 1 / mean1)
            power = st.epochs_for_power(per_epoch, dof, s.alpha, s.power)
        return self.result(ctx, statistic=stat, null=f"chi2({dof}), X2 (N-1)/N", dof=dof,
                           pvalue=float(_stats.chi2.sf(stat, dof)), residuals=resid,
                           detail=f"(position bin in epoch e, in e+1) per key, {c} bins"
                                  + (" incl. 'absent'" if k < n else ""),
                           needed=_needed(valid_epochs(b), None if power is None else power + 1, s.compute_power))

    @staticmethod
    def _tables(pb: np.ndarray, c: int) -> np.ndarray:
        """``[epochs - 1, c * c]``: per consecutive pair, the table of (bin in e, bin in e+1) per key."""
        pairs = pb.shape[0] - 1
        flat = pb[:-1] * c + pb[1:] + (np.arange(pairs) * c * c)[:, None]
        return np.bincount(flat.reshape(-1), minlength=pairs * c * c).reshape(pairs, c * c)


class AllOrders(BatteryTest):
    name = "all_orders"
    question = "are all N! orders equally frequent?"
    kinds = frozenset({"permutation"})
    reference = "buffer2"
    #: Largest N for which the N! orders are counted.
    MAX_N = 6

    def evaluate(self, ctx: _Context) -> Result:
        d, s = ctx.data, ctx.settings
        n = d.n
        if n > self.MAX_N:
            return self.not_applicable(ctx, f"only for N <= {self.MAX_N} (N! cells)")
        cells = math.factorial(n)
        valid = math.ceil(MIN_EXPECTED * cells)
        if d.epochs < valid:
            return self.not_applicable(ctx, f"needs >= {valid} epochs ({MIN_EXPECTED:g} per order)", valid)
        counts = self._counts(d.storage, n)
        x2, resid = st.pearson(counts, np.full(cells, d.epochs / cells))
        dof = cells - 1
        power = None
        if s.compute_power:
            rows = ctx.reference(self.reference)
            onehot = np.zeros((rows.shape[0], cells))
            onehot[np.arange(rows.shape[0]), self._index(rows, n)] = 1
            per_epoch = st.split_half_noncentrality(onehot, np.full(cells, 1 / cells), np.full(cells, float(cells)))
            power = st.epochs_for_power(per_epoch, dof, s.alpha, s.power)
        return self.result(ctx, statistic=x2, null=f"chi2({dof})", dof=dof, pvalue=float(_stats.chi2.sf(x2, dof)),
                           detail=f"{cells} orders, {d.epochs / cells:.1f} expected each", residuals=resid,
                           needed=_needed(valid, power, s.compute_power))

    @staticmethod
    def _index(rows: np.ndarray, n: int) -> np.ndarray:
        """Index of each row among ``itertools.permutations(range(n))`` (lexicographic rank)."""
        code = rows @ (n ** np.arange(n - 1, -1, -1, dtype=np.int64))
        perms = np.array(list(itertools.permutations(range(n))), dtype=np.int64)
        table = perms @ (n ** np.arange(n - 1, -1, -1, dtype=np.int64))
        return np.searchsorted(table, code)

    def _counts(self, rows: np.ndarray, n: int) -> np.ndarray:
        return np.bincount(self._index(rows, n), minlength=math.factorial(n)).astype(np.float64)


#: The battery, in report order.
BATTERY: tuple[BatteryTest, ...] = (
    ItemPosition(), InclusionFrequency(), AdjacentPairs(), JointPositions(), StorageSpearman(),
    LabelsPerBatch(), EpochIndependence(), AllOrders(),
)


def check_fraction(value: float | str, what: str) -> float:
    """A number strictly between 0 and 1 (``ConfigError`` naming ``what`` otherwise)."""
    try:
        a = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: expected a number between 0 and 1 such as 1e-3, found {value!r}") from None
    if not 0 < a < 1:
        raise ConfigError(f"{what}: expected a number strictly between 0 and 1, found {value!r}")
    return a


def run_prepared(data: OrderKeys, settings: Settings) -> Report:
    """Run the battery on already validated keys."""
    ctx = _Context(data, settings)
    results = tuple(test.run(ctx) for test in BATTERY)
    return Report(source=data.source, kind=data.kind, records=data.n, epochs=data.epochs, length=data.length,
                  alpha=settings.alpha, power=settings.power, seed=settings.seed, results=results, notes=data.notes)


def run(
    keys: ArrayOrPath,
    *,
    labels: ArrayOrPath | None = None,
    batch_size: int | str | None = None,
    storage_order: ArrayOrPath | None = None,
    records: int | str | None = None,
    alpha: float = DEFAULTS.alpha,
    power: float = DEFAULTS.power,
    seed: int = DEFAULTS.seed,
    bins: int | str = DEFAULTS.bins,
    null_draws: int | str = DEFAULTS.null_draws,
    compute_power: bool = DEFAULTS.compute_power,
    effect: float = DEFAULTS.effect,
) -> Report:
    """Run the uniformity battery on the keys a loader emitted.

    Parameters
    ----------
    keys
        ``[epochs, k]`` integer keys in emitted order, one row per epoch (or a ``.npy`` file of them).
    labels
        One label per key (``[N]``, or a ``.npy`` file) for the labels-per-batch test.
    batch_size
        The loader's batch size (needed with ``labels``).
    storage_order
        ``[N]`` map key -> storage position (default: the key *is* the storage position), so that
        "storage neighbours" means what it means on disk.
    records
        Records in the dataset, when the rows do not show it (a rank's slice, a partial epoch).
    alpha
        Significance level of every verdict.
    power
        Power the ``epochs_needed`` figures aim for.
    seed
        Seed of the simulated null and of the reference alternatives (results are reproducible).
    bins
        At most this many item and position bins (fewer when the epochs are too few).
    null_draws
        Epochs drawn for the labels test's simulated null.
    compute_power
        Skip the power figures (faster; ``epochs_needed`` then covers the approximation only).
    effect
        Size of the reference alternatives, as a fraction of N: buffer and block shuffles of
        ``effect * N`` records (at least 2); for inclusion frequencies, half of the keys
        ``(1 + effect) / (1 - effect)`` times as likely as the other half.

    Notes
    -----
    The tests (:data:`BATTERY`; each result names its question and null): ``item_position``,
    ``inclusion_frequency`` (k < N, repeats), ``adjacent_pairs``, ``joint_positions``,
    ``storage_spearman``, ``labels_per_batch``, ``epoch_independence``, ``all_orders`` (N <= 6).
    Items and positions go into at most ``bins`` contiguous bins, fewer when the epochs are too few
    for an expected count of 5 per cell. Every random draw comes from ``Domain.ORDER_TEST``.
    """
    settings = Settings(
        alpha=check_fraction(alpha, "alpha"), power=check_fraction(power, "power"), seed=check_seed(seed, what="seed"),
        bins=parse_count(bins, what="bins", minimum=2),
        batch_size=None if batch_size is None else parse_count(batch_size, what="batch_size", minimum=1),
        null_draws=parse_count(null_draws, what="null_draws", minimum=10), compute_power=bool(compute_power),
        effect=check_fraction(effect, "effect"))
    if labels is not None and settings.batch_size is None:
        raise ConfigError("labels: the labels-per-batch test also needs batch_size")
    n = None if records is None else parse_count(records, what="records", minimum=2)
    return run_prepared(prepare(keys, labels=labels, storage_order=storage_order, records=n), settings)
