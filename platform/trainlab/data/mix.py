"""The deterministic token-share schedule: which source each row comes from.

The scheduled unit is one row of `seq_len` tokens taken from one source's
stream (documents in that source's per-epoch order, a long document split
across rows keeping its positions). Every row holds exactly `seq_len` tokens,
so shares of rows are shares of tokens.

Blending follows Megatron's `build_blending_indices`: the next row comes from
the source furthest below its target, i.e. the largest `w_i * (r + 1) - c_i`
(ties go to the earlier source). Every prefix of the stream then matches the
weights to within about one row per source, so a short run and a long run see
the same proportions. Weights are quantized to integers a_i out of Q = 100,000
(a resolution of 1e-5), so the schedule is exact integer arithmetic, identical
on every machine, and periodic: when the counts after Q rows are exactly a_i
(checked, true whenever every prefix stays within one row of its target), the
state repeats every Q rows, so the schedule at any step costs at most Q rows of
simulation instead of a replay from row 0.

A source is repeated epoch by epoch, each epoch in a fresh order from
`epoch_order` (keyed by seed, source name and epoch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from trainlab.data.corpus import splitmix64, stable_hash64
from trainlab.errors import UserError

WEIGHT_SCALE = 100_000
# For a schedule that is not periodic, above this many rows the repetition check
# bounds each source's row count by w*R + 2 instead of running the schedule.
EXACT_CHECK_ROWS = 1 << 22


def normalize_mix(
    mix: Mapping[str, float], available: Mapping[str, int], where: str = "data.mix"
) -> dict[str, float]:
    """Weights summing to 1, in the order of `available` (the manifest's source order).

    An empty mix means every available source in proportion to its tokens."""
    unknown = [name for name in mix if name not in available]
    if unknown:
        raise UserError(
            [
                f"{where}.{name}: no source {name!r} in the prepared dataset "
                f"(sources: {', '.join(available)})"
                for name in unknown
            ]
        )
    raw = (
        {n: float(mix[n]) for n in available if n in mix}
        if mix
        else {n: float(t) for n, t in available.items() if t > 0}
    )
    empty = [n for n in raw if available[n] <= 0]
    if empty:
        raise UserError(
            [
                f"{where}.{n}: source {n!r} has no training tokens (all its "
                "documents are held out for validation, or it is empty)"
                for n in empty
            ]
        )
    total = sum(raw.values())
    if total <= 0:
        raise UserError(f"{where}: no source with training tokens")
    return {n: w / total for n, w in raw.items()}


def quantize_weights(weights: Sequence[float], scale: int = WEIGHT_SCALE) -> list[int]:
    """Integers >= 1 summing to `scale`, proportional to `weights` (largest remainder)."""
    total = float(sum(weights))
    exact = [w / total * scale for w in weights]
    ints = [max(1, int(x)) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    k = 0
    while sum(ints) < scale:
        ints[by_remainder[k % len(ints)]] += 1
        k += 1
    while sum(ints) > scale:
        i = max(range(len(ints)), key=lambda j: (ints[j], -j))
        ints[i] -= 1
    return ints


class BlendSchedule:
    """Row -> source index, as a pure function of the weights.

    Counts are memoized every `memo_every` rows within the first period, so any row
    range is computed from the nearest memo (or from where the last call ended)."""

    def __init__(self, weights: Sequence[float], memo_every: int = 4096, scale: int = WEIGHT_SCALE):
        if not weights:
            raise ValueError("no weights")
        self.scale = scale
        self.a = quantize_weights(weights, scale)
        self.memo_every = memo_every
        self._memo: list[list[int]] = [[0] * len(self.a)]
        self._cursor: tuple[int, list[int]] = (0, [0] * len(self.a))
        self._periodic: bool | None = None  # known once row `scale` has been reached

    @property
    def num_sources(self) -> int:
        return len(self.a)

    def _run(
        self, counts: list[int], start: int, n: int, out: np.ndarray | None = None
    ) -> list[int]:
        """Advance `counts` (a copy) over rows [start, start+n); record choices in `out`."""
        a, scale, c = self.a, self.scale, list(counts)
        s = len(a)
        if s == 1:
            c[0] += n
            if out is not None:
                out[:n] = 0
            return c
        for k in range(n):
            t = start + k + 1
            best_i, best = 0, a[0] * t - c[0] * scale
            for i in range(1, s):
                d = a[i] * t - c[i] * scale
                if d > best:
                    best_i, best = i, d
            c[best_i] += 1
            if out is not None:
                out[k] = best_i
        return c

    def _sequential_counts(self, row: int) -> list[int]:
        block = row // self.memo_every
        while len(self._memo) <= block:
            last = len(self._memo) - 1
            self._memo.append(self._run(self._memo[last], last * self.memo_every, self.memo_every))
        base, counts = block * self.memo_every, self._memo[block]
        if base <= self._cursor[0] <= row:  # sequential reads continue where the last ended
            base, counts = self._cursor
        return self._run(counts, base, row - base)

    @property
    def periodic(self) -> bool:
        """True when the state after `scale` rows equals the start (exact counts a_i)."""
        if self._periodic is None:
            self._periodic = self._sequential_counts(self.scale) == self.a
        return self._periodic

    def counts_at(self, row: int) -> np.ndarray:
        """Rows taken from each source among rows [0, row)."""
        if row < 0:
            raise ValueError(f"row {row} < 0")
        if row >= self.scale and self.periodic:
            periods, rest = divmod(row, self.scale)
            counts = self._sequential_counts(rest)
            return np.array(
                [periods * ai + ci for ai, ci in zip(self.a, counts, strict=True)], dtype=np.int64
            )
        return np.array(self._sequential_counts(row), dtype=np.int64)

    def assign(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """For rows [start, stop): (source index, that source's unit index) per row."""
        counts = self.counts_at(start)
        sources = np.empty(stop - start, dtype=np.int64)
        after = self._run(list(counts), start, stop - start, sources)
        if stop >= self.scale and self.periodic:  # the same state, within the first period
            periods = stop // self.scale
            self._cursor = (
                stop % self.scale,
                [c - periods * ai for c, ai in zip(after, self.a, strict=True)],
            )
        else:
            self._cursor = (stop, after)
        units = np.empty_like(sources)
        for i in range(self.num_sources):
            mask = sources == i
            units[mask] = counts[i] + np.arange(int(mask.sum()))
        return sources, units

    def rows_needed_upper_bound(self, rows: int) -> np.ndarray:
        """Rows per source after `rows` rows: exact when periodic or moderate, else a bound."""
        if rows <= EXACT_CHECK_ROWS or self.periodic:
            return self.counts_at(rows)
        return np.array([ai * rows // self.scale + 2 for ai in self.a], dtype=np.int64)


def epoch_order(seed: int, source: str, epoch: int, n: int) -> np.ndarray:
    """The order of a source's `n` training documents in `epoch`: a permutation fixed
    by (seed, source name, epoch), independent of numpy's RNG implementation."""
    key = np.uint64(stable_hash64("epoch", seed, source, epoch))
    with np.errstate(over="ignore"):
        keys = splitmix64(np.arange(n, dtype=np.uint64) + key)
    return np.argsort(keys, kind="stable")


def check_repetition_cap(
    names: Sequence[str],
    weights: Sequence[float],
    train_tokens: Sequence[int],
    seq_len: int,
    total_rows: int,
    max_epochs: float,
    total_steps: int,
) -> dict[str, float]:
    """Epochs each source needs for `total_rows` rows; a UserError naming every source
    that would need more than `max_epochs` (data.max_epochs_per_source)."""
    rows = BlendSchedule(weights).rows_needed_upper_bound(total_rows)
    needed = {n: float(r) * seq_len / t for n, r, t in zip(names, rows, train_tokens, strict=True)}
    problems = [
        f"data.mix.{n} = {w:.4g} (normalized): source {n!r} needs {needed[n]:.2f} epochs of "
        f"its {t:,} training tokens for train.total_steps={total_steps}, more than "
        f"data.max_epochs_per_source={max_epochs:g}; lower its weight, add data, raise the "
        "cap or shorten the run"
        for n, w, t in zip(names, weights, train_tokens, strict=True)
        if needed[n] > max_epochs
    ]
    if problems:
        raise UserError(problems)
    return needed
