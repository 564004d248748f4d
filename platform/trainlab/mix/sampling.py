"""Which mixtures a swarm trains: a Dirichlet centred on the natural token shares.

RegMix and Olmix sample proxy mixtures around the data's own distribution (the
mix a run gets when it says nothing), with a concentration that sets how far
they stray, and add a few extreme points so the fitted law is not extrapolating
at the edges of the simplex. Weights of 0 are not mixtures trainlab can train
(a source left out is not evaluated either), so every weight is at least
`min_weight`. Each sample must respect `data.max_epochs_per_source` at the
proxy's token budget (`trainlab.data.mix.check_repetition_cap`, the check the
run itself would fail); the infeasible ones are rejected and reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainlab.errors import UserError

MIN_WEIGHT = 0.01
CORNER_SHARE = 0.8  # a near-corner gives one source this share, the rest in natural proportion
MAX_DRAWS_PER_SAMPLE = 50


@dataclass(frozen=True)
class Budget:
    """What the repetition cap depends on: the run's rows, row length and cap."""

    seq_len: int
    total_rows: int  # train.total_steps x global batch
    total_steps: int
    max_epochs: float

    @property
    def tokens(self) -> int:
        return self.seq_len * self.total_rows


@dataclass
class SampleSet:
    mixes: list[dict[str, float]]
    kinds: list[str]  # "uniform", "corner:SOURCE", "dirichlet"
    rejected: int = 0
    rejected_examples: list[dict[str, Any]] = field(default_factory=list)


def natural_shares(train_tokens: dict[str, int]) -> dict[str, float]:
    total = float(sum(train_tokens.values()))
    return {s: t / total for s, t in train_tokens.items()}


def share_caps(train_tokens: dict[str, int], budget: Budget) -> dict[str, float]:
    """The largest share of each source the cap allows at `budget` (up to a row of rounding)."""
    return {s: min(1.0, budget.max_epochs * t / budget.tokens) for s, t in train_tokens.items()}


def feasibility(mix: dict[str, float], train_tokens: dict[str, int], budget: Budget) -> str | None:
    """None when `mix` meets the repetition cap at `budget`, else why not (one line)."""
    from trainlab.data.mix import check_repetition_cap

    names = list(mix)
    try:
        check_repetition_cap(names, [mix[n] for n in names], [train_tokens[n] for n in names],
                             budget.seq_len, budget.total_rows, budget.max_epochs,
                             budget.total_steps)
    except UserError as e:
        return "; ".join(e.lines)
    return None


def _clip(w: np.ndarray, min_weight: float) -> np.ndarray:
    w = np.maximum(w, min_weight)
    return w / w.sum()


def sample_mixtures(train_tokens: dict[str, int], n: int, budget: Budget, *,
                    concentration: float = 5.0, seed: int = 0, special: bool = True,
                    min_weight: float = MIN_WEIGHT) -> SampleSet:
    """`n` feasible mixtures over the sources of `train_tokens` (their order kept).

    With `special`, the uniform mix and one near-corner per source come first
    (when n leaves room for at least as many Dirichlet draws); the rest are draws
    from Dirichlet(concentration x natural shares)."""
    if n < 1:
        raise UserError(f"--runs {n}: need at least 1 run")
    if concentration <= 0:
        raise UserError(f"--concentration {concentration}: must be > 0")
    names = list(train_tokens)
    if len(names) < 2:
        raise UserError(f"a mixture needs at least 2 sources, the swarm has {names}")
    natural = np.array([natural_shares(train_tokens)[s] for s in names])
    rng = np.random.default_rng(seed)
    out = SampleSet([], [])

    def offer(w: np.ndarray, kind: str) -> None:
        mix = {s: round(float(x), 4) for s, x in zip(names, _clip(w, min_weight), strict=True)}
        why = feasibility(mix, train_tokens, budget)
        if why is None:
            out.mixes.append(mix)
            out.kinds.append(kind)
        else:
            out.rejected += 1
            if len(out.rejected_examples) < 5:
                out.rejected_examples.append({"mix": mix, "kind": kind, "reason": why})

    k = len(names)
    if special and n >= 2 * (k + 1):
        offer(np.full(k, 1.0 / k), "uniform")
        for i, s in enumerate(names):
            rest = np.delete(natural, i)
            w = np.insert(rest / rest.sum() * (1 - CORNER_SHARE), i, CORNER_SHARE)
            offer(w, f"corner:{s}")
    draws = 0
    while len(out.mixes) < n and draws < MAX_DRAWS_PER_SAMPLE * n:
        draws += 1
        offer(rng.dirichlet(concentration * natural), "dirichlet")
    if len(out.mixes) < n:
        raise UserError(
            f"only {len(out.mixes)} of {n} sampled mixtures meet data.max_epochs_per_source="
            f"{budget.max_epochs:g} at the proxy's {budget.tokens:,} tokens ({out.rejected} "
            "rejected): raise the cap, shorten the proxy or raise --concentration")
    return out
