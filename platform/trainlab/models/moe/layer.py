"""The MoE layer (a block's MLP in an MoE model), and what the training step
asks of a model's MoE layers.

    out = combine(experts(permute(x, router(x)))) + shared(x)

Training forwards also (1) add the auxiliary balance loss's gradient and (2)
count the step's routing statistics:

- the auxiliary loss (Switch Transformer's, Fedus et al. 2021: E * sum_e f_e *
  P_e, f the fraction of assignments, P the mean probability of expert e) is
  taken per forward as a *sum over its tokens*, N * aux, and multiplied by the
  factor the step multiplies the summed token losses with (`set_loss_scale`:
  data-parallel ranks / the step's labelled tokens), so it is averaged over the
  step's tokens exactly like the main loss, whatever the micro batches and
  ranks. It enters backward as a gradient injected at the layer's output
  (Megatron-LM's MoEAuxLossAutoScaler's way): the model still returns logits
  only. Averaged over the MoE layers, times `aux_loss_coef`.
- per layer: tokens per expert, tokens, dropped assignments, summed router
  entropy and summed aux loss, accumulated over the step's micro batches as
  plain tensors (not buffers: DDP would broadcast them). `finish_step` sums them
  over the data-parallel ranks in one all-reduce after the optimizer step,
  moves the aux-loss-free bias (`balance: bias`) once from the whole step's
  counts, and returns them for the router metrics.

Under activation checkpointing (trainlab.train.parallel.recompute) backward runs
a checkpointed block's forward again to rebuild its saved tensors. That second
forward rebuilds the aux loss's part of the graph like any other (the graph
backward uses is the first forward's, so the injected gradient counts once) but
records no statistics: the recomputation runs inside `recomputing()`, which the
block's checkpoint wrapper enters around it, full or selective. So a token is
counted once per forward whether or not its block is recomputed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainlab.models.moe import dispatch
from trainlab.models.moe.experts import GroupedExperts
from trainlab.models.moe.router import Router

# Columns of a layer's statistics row after its num_experts counts.
STAT_COLUMNS = ("tokens", "dropped", "entropy_sum", "aux_sum")
# What runs the sorted rows through the experts: (rows, counts, experts) -> rows.
Exchange = Callable[[torch.Tensor, torch.Tensor, GroupedExperts], torch.Tensor]

# How many recomputations (activation checkpointing's second forward, run by
# backward) are in progress: a plain module global, not a thread-local, so that a
# compiled block's guards can read it (backward runs the recomputation on the
# thread that runs backward; no forward runs beside it).
_recomputing = 0


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Inside: a checkpointed block's forward run again by backward, whose
    routing statistics the first forward already recorded (MoE layers record
    none). trainlab.train.parallel.recompute enters it as the checkpoint's
    recompute context."""
    global _recomputing
    _recomputing += 1
    try:
        yield
    finally:
        _recomputing -= 1


class SharedExperts(nn.Module):
    """Experts every token goes through (DeepSeek-MoE): one SwiGLU of width
    shared_experts x the expert width."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate = nn.Linear(hidden, width, bias=False)
        self.up = nn.Linear(hidden, width, bias=False)
        self.proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


class _InjectAuxGrad(torch.autograd.Function):
    """Identity on `out`; in backward, `aux` gets the gradient `scale`."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> Any:
        ctx.save_for_backward(scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (scale,) = ctx.saved_tensors
        return grad, scale, None


class MoE(nn.Module):
    def __init__(self, moe: Any, hidden: int, width: int, moe_layers: int):
        super().__init__()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.capacity_factor = moe.capacity_factor
        self.aux_coef = moe.aux_loss_coef if moe.balance == "aux_loss" else 0.0
        self.layer_share = 1.0 / moe_layers  # the aux loss is averaged over the MoE layers
        r = moe.router
        self.router = Router(
            hidden, moe.num_experts, moe.top_k, r.score, r.normalize_top_k, moe.balance == "bias"
        )
        self.experts = GroupedExperts(moe.num_experts, hidden, width)
        self.shared = (
            SharedExperts(hidden, moe.shared_experts * width) if moe.shared_experts else None
        )
        # Set by the step (set_loss_scale); None: the mean over this forward's tokens.
        self.loss_scale: torch.Tensor | None = None
        # Expert parallelism (trainlab.train.parallel.expert) sets the all-to-all here.
        self.exchange: Exchange | None = None
        self.step_stats: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n, e = flat.shape[0], self.num_experts
        routing = self.router(flat)
        capacity = dispatch.capacity_of(n, self.top_k, e, self.capacity_factor)
        p = dispatch.permute(flat, routing, e, capacity)
        if self.exchange is None:
            y = self.experts(p.rows, p.counts)
        else:
            y = self.exchange(p.rows, p.counts, self.experts)
        out = dispatch.combine(y, p, routing.weights)
        if self.training and torch.is_grad_enabled():
            f = p.routed.to(routing.probs.dtype) / (n * self.top_k)
            aux_sum = e * (f * routing.probs.sum(0)).sum()
            if self.aux_coef > 0:
                scale = self.loss_scale if self.loss_scale is not None else 1.0 / n
                scale = torch.as_tensor(scale, dtype=aux_sum.dtype, device=aux_sum.device)
                out = _InjectAuxGrad.apply(out, aux_sum, self.aux_coef * self.layer_share * scale)
            if not _recomputing:  # recomputed: the first forward recorded them
                self._record(routing.probs.detach(), p, aux_sum.detach(), n)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(shape)

    def _record(self, probs: torch.Tensor, p: dispatch.Permuted, aux: torch.Tensor, n: int) -> None:
        entropy = -(probs * probs.clamp(min=1e-30).log()).sum()
        row = torch.cat(
            [
                p.routed.double(),
                torch.stack(
                    [
                        torch.tensor(float(n), dtype=torch.float64, device=probs.device),
                        p.dropped.double(),
                        entropy.double(),
                        aux.double(),
                    ]
                ),
            ]
        )
        self.step_stats = row if self.step_stats is None else self.step_stats + row

    def take_stats(self, device: torch.device) -> torch.Tensor:
        """This step's statistics row (zeros when no training forward ran), reset."""
        row, self.step_stats = self.step_stats, None
        if row is None:
            return torch.zeros(
                self.num_experts + len(STAT_COLUMNS), dtype=torch.float64, device=device
            )
        return row


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of `model` (through DDP/FSDP wrappers), in model order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_loss_scale(model: nn.Module, scale: torch.Tensor | None) -> None:
    """The factor the step multiplies its summed token losses with (the aux loss's too)."""
    for layer in moe_layers(model):
        layer.loss_scale = scale


def finish_step(
    layers: list[MoE],
    reduce: Callable[[torch.Tensor], torch.Tensor],
    bias_rate: float,
    device: torch.device,
) -> torch.Tensor | None:
    """After the optimizer step: the step's statistics of every layer summed by
    `reduce` (over the data-parallel ranks: one all-reduce), the aux-loss-free
    biases moved by `bias_rate` toward balance (DeepSeek-V3: + rate for an expert
    below the mean load, - rate above; unchanged when nothing was routed), the
    counters reset. Returns [layers, E + 4] statistics (STAT_COLUMNS), or None
    without MoE layers. Nothing is read back to the host."""
    if not layers:
        return None
    stats = reduce(torch.stack([layer.take_stats(device) for layer in layers]))
    for layer, row in zip(layers, stats, strict=True):
        bias = layer.router.expert_bias
        if bias is not None:
            counts = row[: layer.num_experts]
            bias.add_(torch.sign(counts.mean() - counts).float() * bias_rate)
    return stats
