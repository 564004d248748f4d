"""Dispatch of an MoE layer: the router's (token, expert) assignments sorted by
expert into one block of rows (what the grouped experts read), dropped past a
capacity when one is set, and the experts' rows combined back per token.

Sorting is a stable argsort of the N*k expert ids, so the order of rows within
an expert is the tokens' order: deterministic on every device. Combining
scatters the rows back to their (token, k) slots and sums the k slots of a
token in a fixed order (no atomics: bitwise reproducible).

Under expert parallelism the block goes to the experts' ranks by all-to-all
(trainlab.train.parallel.expert) between `permute` and `combine`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from trainlab.models.moe.router import Routing


class Permuted(NamedTuple):
    rows: torch.Tensor  # [M, h] the kept assignments' token rows, sorted by expert
    counts: torch.Tensor  # [E] rows per expert in `rows` (int64)
    slots: torch.Tensor  # [M] each row's (token * k + choice) slot
    routed: torch.Tensor  # [E] assignments per expert before any drop (int64)
    dropped: torch.Tensor  # () assignments dropped past the capacity (int64)


def capacity_of(tokens: int, top_k: int, num_experts: int, factor: float | None) -> int | None:
    """Rows an expert takes per forward: ceil(factor * tokens * k / E); None: dropless."""
    if factor is None:
        return None
    return math.ceil(factor * tokens * top_k / num_experts)


def permute(x: torch.Tensor, routing: Routing, num_experts: int, capacity: int | None) -> Permuted:
    """Rows of `x` [N, h] for every kept assignment, sorted by expert."""
    flat = routing.experts.reshape(-1)
    order = flat.argsort(stable=True)
    # Per-expert counts from the sorted ids: no host read (bincount's output size
    # reads the largest id back on CUDA), no atomics.
    edges = torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype)
    bounds = torch.searchsorted(flat[order], edges)
    routed = bounds[1:] - bounds[:-1]
    counts = routed
    dropped = torch.zeros((), dtype=torch.int64, device=x.device)
    if capacity is not None:
        starts = routed.cumsum(0) - routed
        rank_in_expert = torch.arange(flat.numel(), device=x.device) - starts[flat[order]]
        order = order[rank_in_expert < capacity]  # a host read: the kept count
        counts = routed.clamp(max=capacity)
        dropped = routed.sum() - counts.sum()
    k = routing.experts.shape[1]
    return Permuted(x[order // k], counts, order, routed, dropped)


def combine(y: torch.Tensor, p: Permuted, weights: torch.Tensor) -> torch.Tensor:
    """Each token's output: the weighted sum of its experts' rows `y` [M, h]
    (weights [N, k], fp32; a dropped assignment contributes nothing)."""
    n, k = weights.shape
    w = weights.reshape(-1)[p.slots].unsqueeze(-1)
    slots = y.new_zeros(n * k, y.shape[1])
    slots = slots.index_copy(0, p.slots, (y.float() * w).to(y.dtype))
    return slots.view(n, k, -1).sum(1)
