"""Mixtures of datasets with weights: the mixed epoch order as pure arithmetic on keys (docs/design.md §12).

Dataset ``i``'s record ``k`` is global key ``offsets[i] + k``; :meth:`MixturePlan.stream` gives an
epoch as global keys, :meth:`MixturePlan.pairs` as ``(dataset index, record key)``.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from shardkit.errors import ConfigError
from shardkit.order.schedule import EpochOrder, epoch_permutation
from shardkit.order.seeds import Domain, check_seed, rng
from shardkit.units import parse_count

__all__ = [
    "HEAD",
    "TAIL",
    "MIDDLE",
    "MAX_EPOCH_SIZE",
    "parse_weights",
    "epoch_counts",
    "walk_bounds",
    "Walks",
    "MixturePlan",
    "PlanOrder",
]

#: Parts of :attr:`Domain.MIXTURE` (part of the numbers drawn: never renumber; 3 is retired).
HEAD, TAIL, MIDDLE = 0, 1, 2
#: Largest epoch length accepted: an epoch's order holds 8 bytes per slot in RAM.
MAX_EPOCH_SIZE = 1 << 40


# ---------------------------------------------------------------------------------------------- counts
def parse_weights(weights: Sequence[object], *, what: str = "weights") -> tuple[Fraction, ...]:
    """Relative weights as exact positive fractions: floats and strings (``"0.25"``, ``"1/3"``) at
    their decimal spelling, so ``0.1`` is exactly one tenth; each must be finite and positive."""
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or not weights:
        raise ConfigError(f"{what}: expected one positive number per dataset, found {weights!r}")
    out: list[Fraction] = []
    for i, w in enumerate(weights):
        value: Fraction | None = None
        flag = isinstance(w, (bool, np.bool_))
        if isinstance(w, Fraction):
            value = w
        elif isinstance(w, numbers.Integral) and not flag:
            value = Fraction(int(w))
        elif isinstance(w, (numbers.Real, str)) and not flag:
            try:  # a float at its shortest decimal spelling: 0.1 is one tenth
                value = Fraction(w.strip() if isinstance(w, str) else repr(float(w)))
            except (ValueError, ZeroDivisionError):
                value = None
        if value is None or value <= 0:
            raise ConfigError(f"{what}: weight {i} must be a finite number > 0 (such as 3, 0.25 or 1/3), found {w!r}")
        out.append(value)
    return tuple(out)


def epoch_counts(weights: Sequence[object], epoch_size: int) -> tuple[int, ...]:
    """``n_i``: the largest-remainder rounding of ``w_i L / sum(w)``, in exact rational arithmetic
    (docs/design.md §12, exact counts); they sum to ``L``, ties go to the lower index."""
    ws = parse_weights(weights)
    total = int(epoch_size)
    whole = sum(ws, Fraction(0))
    quotas = [w * total / whole for w in ws]
    counts = [math.floor(q) for q in quotas]
    left = total - sum(counts)
    by_remainder = sorted(range(len(ws)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[:left]:
        counts[i] += 1
    return tuple(counts)


# ---------------------------------------------------------------------------------------------- walks
def walk_bounds(walk: int, size: int, extras: int) -> tuple[int, int]:
    """``(h, t)``: how many leading and trailing records of walk ``walk`` (covering extras positions
    ``[w N, (w+1) N)``) belong to epochs that straddle its start and end, ``extras`` per epoch."""
    n, r, w = int(size), int(extras), int(walk)
    if r == 0:
        return 0, 0
    start, end = w * n, (w + 1) * n
    head = 0 if start % r == 0 else r - start % r
    return head, end % r


def _sample_outside(gen: np.random.Generator, n: int, k: int, excluded: np.ndarray) -> np.ndarray:
    """A uniformly random ordered ``k``-sample of ``range(n)`` without the keys in ``excluded``."""
    ex = np.unique(excluded)
    idx = gen.choice(n - ex.size, size=k, replace=False, shuffle=True).astype(np.int64, copy=False)
    if ex.size:
        # The j-th kept key is j plus the number of excluded keys at or below it.
        adjusted = ex - np.arange(ex.size, dtype=np.int64)
        idx = idx + np.searchsorted(adjusted, idx, side="right")
    return idx


class Walks:
    """Dataset ``dataset``'s extras, epoch by epoch (docs/design.md §12, walks): walk ``w`` is
    ``[head | middle | tail]``, the head drawn outside the previous tail. Keeps the last tail and
    walk, so epochs in increasing order cost one walk per walk; thread-safe. ``seed`` and ``dataset``
    are the mixture's seed and this dataset's index, ``size`` its ``N`` records, ``extras`` the ``r``
    extras per epoch (``0 <= r < N``)."""

    def __init__(self, seed: int, dataset: int, size: int, extras: int) -> None:
        self.seed, self.dataset, self.size, self.extras = int(seed), int(dataset), int(size), int(extras)
        if not 0 <= self.extras < self.size:
            raise ConfigError(f"walks: expected 0 <= extras < size, found extras={extras}, size={size}")
        # Walks between two chain restarts (walks that begin on an epoch boundary).
        self._period = self.extras // math.gcd(self.size, self.extras) if self.extras else 1
        self._lock = threading.Lock()
        self._tail: tuple[int, np.ndarray] | None = None  # (w, T_w)
        self._walk: tuple[int, np.ndarray] | None = None  # (w, whole walk w)
        self._straddling: tuple[int, np.ndarray] | None = None  # (e, extras of an epoch across two walks)

    def _gen(self, part: int, walk: int) -> np.random.Generator:
        return rng(Domain.MIXTURE, self.seed, part, self.dataset, walk)

    def _head_and_tail(self, walk: int, prev_tail: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        h, t = walk_bounds(walk, self.size, self.extras)
        head = _sample_outside(self._gen(HEAD, walk), self.size, h, prev_tail)
        tail = _sample_outside(self._gen(TAIL, walk), self.size, t, head)
        return head, tail

    def _tail_before(self, walk: int) -> np.ndarray:
        """``T_{walk-1}`` (empty for walk 0 and for a walk that begins on an epoch boundary)."""
        if walk == 0 or walk_bounds(walk, self.size, self.extras)[0] == 0:
            return np.empty(0, dtype=np.int64)
        if self._tail is not None and self._tail[0] == walk - 1:
            return self._tail[1]
        # Replay from the last restart at or before walk - 1 (or from the kept tail, if later).
        v = ((walk - 1) // self._period) * self._period
        tail = np.empty(0, dtype=np.int64)
        if self._tail is not None and v <= self._tail[0] < walk - 1:
            v, tail = self._tail[0] + 1, self._tail[1]
        for u in range(v, walk):
            tail = self._head_and_tail(u, tail)[1]
        self._tail = (walk - 1, tail)
        return tail

    def walk(self, walk: int) -> np.ndarray:
        """The whole walk ``walk``: a permutation of ``range(N)`` (int64)."""
        with self._lock:
            return self._whole(int(walk)).copy()

    def _whole(self, walk: int) -> np.ndarray:
        if self._walk is not None and self._walk[0] == walk:
            return self._walk[1]
        head, tail = self._head_and_tail(walk, self._tail_before(walk))
        mask = np.ones(self.size, dtype=bool)
        mask[head] = False
        mask[tail] = False
        middle = self._gen(MIDDLE, walk).permutation(np.flatnonzero(mask))
        whole = np.concatenate([head, middle, tail]).astype(np.int64, copy=False)
        self._tail = (walk, tail)
        self._walk = (walk, whole)
        return whole

    def epoch(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s ``r`` extras: distinct record keys, in walk order (int64)."""
        e, n, r = int(epoch), self.size, self.extras
        if r == 0:
            return np.empty(0, dtype=np.int64)
        a, b = e * r, (e + 1) * r
        w0, w1 = a // n, (b - 1) // n
        with self._lock:
            if w0 == w1:
                return self._whole(w0)[a - w0 * n : b - w0 * n].copy()
            if self._straddling is not None and self._straddling[0] == e:
                return self._straddling[1].copy()
            # The epoch straddles walks w0 and w1 = w0 + 1: the tail of one and the head of the next.
            tail = self._tail_before(w1)
            head = _sample_outside(self._gen(HEAD, w1), n, b - w1 * n, tail)
            self._straddling = (e, np.concatenate([tail, head]))
            return self._straddling[1].copy()


# ---------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class MixturePlan:
    """The mixed order of a mixture, every epoch on demand; build it with :meth:`create`."""

    #: ``N_i``, records per dataset.
    sizes: tuple[int, ...]
    #: ``w_i``, exact relative weights.
    weights: tuple[Fraction, ...]
    #: ``L``, slots per epoch.
    epoch_size: int
    #: ``n_i``, records of dataset ``i`` per epoch (:func:`epoch_counts`).
    counts: tuple[int, ...]
    seed: int
    _walks: tuple[Walks, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        walks = tuple(Walks(self.seed, i, n, c % n) for i, (n, c) in enumerate(zip(self.sizes, self.counts)))
        object.__setattr__(self, "_walks", walks)

    @classmethod
    def create(
        cls, sizes: Sequence[int], weights: Sequence[object], epoch_size: int | str | None = None, seed: int = 0
    ) -> MixturePlan:
        """Validate the inputs (errors name ``weights``, ``epoch_size``, ``seed``) and round the counts."""
        ws = parse_weights(weights)
        ns = tuple(parse_count(n, what=f"dataset {i} size", minimum=1) for i, n in enumerate(sizes))
        if len(ns) != len(ws):
            raise ConfigError(f"weights: expected one weight per dataset ({len(ns)}), found {len(ws)}")
        length = sum(ns) if epoch_size is None else parse_count(epoch_size, what="epoch_size", minimum=1)
        if length > MAX_EPOCH_SIZE:
            raise ConfigError(
                f"epoch_size: an epoch's order holds 8 bytes per slot in RAM; expected at most {MAX_EPOCH_SIZE}, "
                f"found {length}"
            )
        s = check_seed(seed)
        return cls(sizes=ns, weights=ws, epoch_size=length, counts=epoch_counts(ws, length), seed=s)

    @property
    def offsets(self) -> np.ndarray:
        """First global key of each dataset, and the total as the last entry (``m + 1`` values)."""
        return np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]).astype(np.int64)

    def dataset_keys(self, dataset: int, epoch: int) -> np.ndarray:
        """Dataset ``dataset``'s ``n_i`` record keys of epoch ``epoch``: ``q_i`` copies of every
        record, then the epoch's extras (walk order; the arrangement shuffles them)."""
        i = int(dataset)
        n, c = self.sizes[i], self.counts[i]
        full = np.tile(np.arange(n, dtype=np.int64), c // n)
        return np.concatenate([full, self._walks[i].epoch(epoch)])

    @property
    def single(self) -> bool:
        """One dataset, every record once per epoch: the order is the slot order itself."""
        return self.counts == self.sizes and len(self.sizes) == 1

    def slot_keys(self, epoch: int, slots: np.ndarray) -> np.ndarray:
        """The global keys in epoch ``epoch``'s item table at ``slots``: dataset ``i``'s slots (after
        those of ``0..i-1``) hold its items as :meth:`dataset_keys` lists them. For a :attr:`single`
        dataset the slots are the keys: ``slots`` itself is returned when it is an int64 array."""
        s = np.asarray(slots, dtype=np.int64)
        if self.single:
            return s
        bounds = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)]).astype(np.int64)
        # Vectorised over all datasets at once (a few passes over the slots, not a few per dataset):
        # slot j of dataset i holds copy j // N_i of record j % N_i, or an extra of the walk.
        ds = np.searchsorted(bounds, s, side="right") - 1
        keys = s - bounds[ds]
        sizes = np.asarray(self.sizes, dtype=np.int64)
        if any(c > n for n, c in zip(self.sizes, self.counts)):
            np.remainder(keys, sizes[ds], out=keys)  # whole copies: the record's key
        whole = np.asarray([c - c % n for n, c in zip(self.sizes, self.counts)], dtype=np.int64)
        extra = np.flatnonzero(s >= bounds[ds] + whole[ds])
        if extra.size:  # the extras: a walk's records, dataset by dataset
            ds_extra = ds[extra]
            for i in np.unique(ds_extra).tolist():
                at = extra[ds_extra == i]
                keys[at] = self._walks[i].epoch(epoch)[s[at] - bounds[i] - whole[i]]
        keys += self.offsets[ds]
        return keys

    def stream(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s mixed order as ``L`` global keys: the item table in the order of
        :func:`~shardkit.order.schedule.epoch_permutation` (docs/design.md §12)."""
        return self.slot_keys(epoch, epoch_permutation(self.seed, epoch, self.epoch_size))

    def split(self, global_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset index, record key)`` of each global key."""
        g = np.asarray(global_keys, dtype=np.int64)
        off = self.offsets
        ds = np.searchsorted(off, g, side="right") - 1
        return ds.astype(np.int64), g - off[ds]

    def global_keys(self, datasets: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The global key of each ``(dataset index, record key)``."""
        return self.offsets[np.asarray(datasets, dtype=np.int64)] + np.asarray(keys, dtype=np.int64)

    def pairs(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s mixed order as ``[L, 2]`` int64 (dataset index, record key)."""
        ds, keys = self.split(self.stream(epoch))
        out: np.ndarray = np.stack([ds, keys], axis=1)
        return out


@dataclass(frozen=True, eq=False)
class PlanOrder:
    """An epoch's order of global keys: the slot order ``slots`` read through the plan's item table."""

    plan: MixturePlan
    epoch: int
    slots: EpochOrder

    @property
    def size(self) -> int:
        return self.slots.size

    def keys(self, positions: np.ndarray) -> np.ndarray:
        return self.plan.slot_keys(self.epoch, self.slots.keys(positions))
