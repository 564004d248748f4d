"""The deterministic token-share schedule: which source each row comes from.

The scheduled unit is one row of `seq_len` tokens taken from one source's
stream (documents in that source's per-epoch order, a long document split
across rows keeping its positions). Every row holds exactly `seq_len` tokens,
so shares of rows are shares of tokens.

Blending follows Megatron's `build_blending_indices`: the next row comes from
the source furthest below its target, i.e. the largest `w_i * (r + 1) - c_i`
(ties go to the earlier source). Every prefix of the stream then matches the
weights to within about one row per source, so a short run and a long run see
the same proportions. Weights are quantized to integers out of 2**32 so the
schedule is exact integer arithmetic, identical on every machine.

A source is repeated epoch by epoch, each epoch in a fresh order from
`epoch_order` (keyed by seed, source name and epoch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from trainlab.data.corpus import splitmix64, stable_hash64
from trainlab.errors import UserError

WEIGHT_SCALE = 1 << 32
# Above this many rows the repetition check bounds each source's row count by
# w*R + 2 instead of running the schedule (the prefix error stays below ~1.2 rows).
EXACT_CHECK_ROWS = 1 << 22


def normalize_mix(mix: Mapping[str, float], available: Mapping[str, int],
                  where: str = "data.mix") -> dict[str, float]:
    """Weights summing to 1, in the order of `available` (the manifest's source order).

    An empty mix means every available source in proportion to its tokens."""
    unknown = [name for name in mix if name not in available]
    if unknown:
        raise UserError([f"{where}.{name}: no source {name!r} in the prepared dataset "
                         f"(sources: {', '.join(available)})" for name in unknown])
    raw = {n: float(mix[n]) for n in available if n in mix} if mix else {
        n: float(t) for n, t in available.items() if t > 0}
    empty = [n for n in raw if available[n] <= 0]
    if empty:
        raise UserError([f"{where}.{n}: source {n!r} has no training tokens (all its "
                         "documents are held out for validation, or it is empty)" for n in empty])
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

    Counts are memoized every `memo_every` rows, so any row range is computed from
    the nearest memo instead of from row 0 (resume is cheap after the first pass)."""

    def __init__(self, weights: Sequence[float], memo_every: int = 4096):
        if not weights:
            raise ValueError("no weights")
        self.a = quantize_weights(weights)
        self.memo_every = memo_every
        self._memo: list[list[int]] = [[0] * len(self.a)]
        self._cursor: tuple[int, list[int]] = (0, [0] * len(self.a))

    @property
    def num_sources(self) -> int:
        return len(self.a)

    def _run(self, counts: list[int], start: int, n: int,
             out: np.ndarray | None = None) -> list[int]:
        """Advance `counts` (a copy) over rows [start, start+n); record choices in `out`."""
        a, scale, c = self.a, WEIGHT_SCALE, list(counts)
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

    def counts_at(self, row: int) -> np.ndarray:
        """Rows taken from each source among rows [0, row)."""
        if row < 0:
            raise ValueError(f"row {row} < 0")
        block = row // self.memo_every
        while len(self._memo) <= block:
            last = len(self._memo) - 1
            self._memo.append(self._run(self._memo[last], last * self.memo_every,
                                        self.memo_every))
        base, counts = block * self.memo_every, self._memo[block]
        if base <= self._cursor[0] <= row:  # sequential reads continue where the last ended
            base, counts = self._cursor
        return np.array(self._run(counts, base, row - base), dtype=np.int64)

    def assign(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """For rows [start, stop): (source index, that source's unit index) per row."""
        counts = self.counts_at(start)
        sources = np.empty(stop - start, dtype=np.int64)
        self._cursor = (stop, self._run(list(counts), start, stop - start, sources))
        units = np.empty_like(sources)
        for i in range(self.num_sources):
            mask = sources == i
            units[mask] = counts[i] + np.arange(int(mask.sum()))
        return sources, units

    def rows_needed_upper_bound(self, rows: int) -> np.ndarray:
        """Rows per source after `rows` rows: exact for moderate runs, else a safe bound."""
        if rows <= EXACT_CHECK_ROWS:
            return self.counts_at(rows)
        return np.array([ai * rows // WEIGHT_SCALE + 2 for ai in self.a], dtype=np.int64)


def epoch_order(seed: int, source: str, epoch: int, n: int) -> np.ndarray:
    """The order of a source's `n` training documents in `epoch`: a permutation fixed
    by (seed, source name, epoch), independent of numpy's RNG implementation."""
    key = np.uint64(stable_hash64("epoch", seed, source, epoch))
    with np.errstate(over="ignore"):
        keys = splitmix64(np.arange(n, dtype=np.uint64) + key)
    return np.argsort(keys, kind="stable")


def check_repetition_cap(names: Sequence[str], weights: Sequence[float],
                         train_tokens: Sequence[int], seq_len: int, total_rows: int,
                         max_epochs: float, total_steps: int) -> dict[str, float]:
    """Epochs each source needs for `total_rows` rows; a UserError naming every source
    that would need more than `max_epochs` (data.max_epochs_per_source)."""
    rows = BlendSchedule(weights).rows_needed_upper_bound(total_rows)
    needed = {n: float(r) * seq_len / t for n, r, t in zip(names, rows, train_tokens, strict=True)}
    problems = [
        f"data.mix.{n} = {w:.4g} (normalized): source {n!r} needs {needed[n]:.2f} epochs of "
        f"its {t:,} training tokens for train.total_steps={total_steps}, more than "
        f"data.max_epochs_per_source={max_epochs:g}; lower its weight, add data, raise the "
        "cap or shorten the run"
        for n, w, t in zip(names, weights, train_tokens, strict=True) if needed[n] > max_epochs]
    if problems:
        raise UserError(problems)
    return needed
