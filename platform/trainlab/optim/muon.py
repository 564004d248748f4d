"""Muon: momentum orthogonalised by Newton-Schulz for the hidden weight matrices,
AdamW for everything else (Keller Jordan, "Muon: An optimizer for hidden layers
in neural networks", 2024; Moonshot AI, "Muon is Scalable for LLM Training"
(Moonlight), 2025).

Which parameters: every 2-D weight inside a transformer block (`model.layers`)
takes the Muon update; embeddings, the output head, norms and biases take AdamW
(the same lr, betas and eps as `adamw`).

The update of a matrix W (r x c) with gradient G, momentum mu, lr eta, weight
decay lambda:

    B  <- mu B + (1 - mu) G                    (momentum, fp32, in place)
    U  <- (1 - mu) G + mu B   (nesterov)  or  B
    O  <- NewtonSchulz5(U)                     (~ U V^T of U's SVD; in ns_precision)
    W  <- (1 - eta lambda) W - eta * 0.2 sqrt(max(r, c)) O

The 0.2 sqrt(max(r, c)) factor is Moonlight's: it gives O the RMS of a typical
AdamW update, so one learning rate and one schedule serve both kinds of
parameters. Newton-Schulz uses Keller Jordan's quintic coefficients (3.4445,
-4.7750, 2.0315) on U / ||U||_F, the matrix transposed to be wide.

Sharded matrices (FSDP2's dim-0 shards over dp, tensor parallelism's row or
column shards over tp: both DTensors): orthogonalisation is not elementwise, so
each rank all-gathers the momentum-corrected update U of one matrix at a time
(`full_tensor()`), runs Newton-Schulz on the whole matrix, and keeps its own
shard of O (a redistribution from Replicate to the parameter's placements, a
local slice). Every rank computes the same O redundantly: simple and exact (the
model trained does not depend on the layout); the price is one all-gather of
each hidden matrix per step and every rank's NS flops over the whole model. A
distributed Muon that gives each rank whole matrices to orthogonalise and
scatters the results would cut both; not done here.

State per parameter: the momentum buffer B (4 bytes per element) for Muon's
matrices; exp_avg, exp_avg_sq (8 bytes) and a 4-byte step per tensor for the
AdamW ones. During `step()`, for the largest hidden matrix at a time: U (4 bytes
per local element), the gathered U (4 per element when sharded), and Newton-Schulz's
working set in ns_precision (s bytes): the normalised copy (and the cast copy
when s < 4), then X, A = X X^T, B = bA + cA^2 and the next X: 2s(rc + m^2), m =
min(r, c).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from trainlab.optim import register_optimizer
from trainlab.optim.base import OptimizerConfig, PlanParam, StepMemory, decay_groups, trainable

if TYPE_CHECKING:
    import torch
    from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
# Moonlight's update scale: 0.2 * sqrt(max(rows, cols)) matches AdamW's update RMS.
RMS_MATCH = 0.2


@register_optimizer
class MuonConfig(OptimizerConfig):
    name: Literal["muon"] = "muon"
    # Momentum of the hidden matrices' update, and whether it is Nesterov's.
    momentum: float = Field(0.95, ge=0.0, lt=1.0)
    nesterov: bool = True
    # Newton-Schulz iterations, and the precision they run in (bf16 as Muon's
    # authors do; fp32 for an exact reference).
    ns_steps: int = Field(5, ge=1, le=20)
    ns_precision: Literal["bf16", "fp32"] = "bf16"
    # Decoupled weight decay (Moonlight: needed at scale); on matrices and
    # embeddings, none on norms and biases.
    weight_decay: float = Field(0.1, ge=0.0, le=10.0)
    # AdamW's, for embeddings, the head, norms and biases.
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, gt=0, le=1e-2)

    def build(self, model: nn.Module, lr: float, zero1: bool = False) -> torch.optim.Optimizer:
        hidden = {id(p) for p in hidden_matrices(model)}
        params = trainable(model)
        groups: list[dict[str, Any]] = []
        matrices = [p for p in params if id(p) in hidden]
        if matrices:
            groups.append({"params": matrices, "use_muon": True, "weight_decay": self.weight_decay})
        rest = [p for p in params if id(p) not in hidden]
        groups += [{**g, "use_muon": False} for g in decay_groups(rest, self.weight_decay)]
        defaults = {
            "lr": lr,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "ns_steps": self.ns_steps,
            "ns_precision": self.ns_precision,
            "betas": (self.beta1, self.beta2),
            "eps": self.eps,
        }
        cls = muon_class()
        if zero1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls,
                                          **{**defaults, **_options(groups[0])})
            for group in groups[1:]:
                opt.add_param_group(group)
            return opt
        return cls(groups, **defaults)

    def create_state(self, optimizer: torch.optim.Optimizer) -> None:
        local = getattr(optimizer, "optim", optimizer)
        for group in local.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    local.init_param_state(p, group)

    def plan_groups(self, params: list[PlanParam]) -> list[list[PlanParam]]:
        matrices = [p for p in params if is_hidden_matrix(p.layer, p.shape)]
        rest = [p for p in params if not is_hidden_matrix(p.layer, p.shape)]
        return [g for g in (matrices, *super().plan_groups(rest)) if g]

    def memory(self, params: list[PlanParam], gpu: bool) -> StepMemory:
        matrices = [p for p in params if is_hidden_matrix(p.layer, p.shape)]
        rest = [p for p in params if not is_hidden_matrix(p.layer, p.shape)]
        state = 4 * sum(p.local for p in matrices)
        state += 8 * sum(p.local for p in rest) + 4 * len(rest)
        s = 2 if self.ns_precision == "bf16" else 4
        temp = 0.0
        for p in matrices:
            if p.local <= 0:
                continue
            full, m = float(p.numel), float(min(p.shape))
            u = 4 * p.local
            gathered = 4 * full if p.sharded else 0.0
            start = u + gathered + (s * full if s < 4 else 0.0) + s * full
            loop = u + 2 * s * (full + m * m)
            apply = (s + 4) * p.local  # this rank's shard of O, cast to the weights' fp32
            temp = max(temp, start, loop, apply)
        # AdamW's part, one tensor at a time: sqrt(exp_avg_sq) and its quotient.
        temp = max(temp, 8 * max((p.local for p in rest), default=0.0))
        return StepMemory(state, temp)


def _options(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def is_hidden_matrix(layer: int | None, shape: tuple[int, ...]) -> bool:
    """Whether Muon updates this parameter: a 2-D weight inside a block."""
    return layer is not None and len(shape) == 2


def hidden_matrices(model: nn.Module) -> list[Any]:
    """The 2-D parameters of the model's repeated blocks (DDP's wrapper looked
    through; a pipeline stage holds its own blocks)."""
    from trainlab.models.measured import repeated_blocks

    inner = getattr(model, "module", model)
    return [
        p
        for b in repeated_blocks(inner)
        for p in b.parameters()
        if p.requires_grad and p.dim() == 2
    ]


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonal factor U V^T of g = U S V^T, approximately (singular values
    land in ~[0.7, 1.2]): the quintic iteration on g / ||g||_F, in `dtype`."""
    import torch

    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    x = x / (x.norm() + NS_EPS)
    del g
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    for _ in range(steps):
        s = x @ x.mT
        s = torch.addmm(s, s, s, beta=b, alpha=c)
        x = torch.addmm(x, s, x, beta=a, alpha=1.0)
        del s
    return x.mT if tall else x


def orthogonalise(u: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz of a whole matrix; a DTensor (FSDP2 or tensor-parallel shard)
    is gathered first and the result given back with its placements."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(u, DTensor):
        return newton_schulz(u, steps, dtype)
    mesh, placements = u.device_mesh, u.placements
    whole = newton_schulz(u.full_tensor(), steps, dtype)
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, placements)


@functools.cache
def muon_class() -> type:
    """The torch optimizer (defined on first use: this module imports no torch)."""
    import torch

    class Muon(torch.optim.Optimizer):
        """Param groups with `use_muon` True take the Muon update, the others AdamW."""

        def __init__(self, params: Any, **defaults: Any) -> None:
            defaults.setdefault("use_muon", False)
            defaults.setdefault("weight_decay", 0.0)
            super().__init__(params, defaults)

        def init_param_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
            state = self.state[p]
            if not state:
                if group["use_muon"]:
                    state["momentum_buffer"] = torch.zeros_like(p)
                else:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
            return state

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if group["use_muon"]:
                        self._muon(p, group)
                    else:
                        self._adamw(p, group)
            return loss

        def _muon(self, p: torch.Tensor, group: dict[str, Any]) -> None:
            state = self.init_param_state(p, group)
            g, buf, mu = p.grad, state["momentum_buffer"], group["momentum"]
            buf.lerp_(g, 1 - mu)
            u = g.lerp(buf, mu) if group["nesterov"] else buf
            dtype = torch.bfloat16 if group["ns_precision"] == "bf16" else torch.float32
            o = orthogonalise(u, group["ns_steps"], dtype)
            del u
            lr = group["lr"]
            rows, cols = p.shape  # the whole matrix's, also for a DTensor shard
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(o.to(p.dtype), alpha=-lr * RMS_MATCH * math.sqrt(max(rows, cols)))

        def _adamw(self, p: torch.Tensor, group: dict[str, Any]) -> None:
            state = self.init_param_state(p, group)
            g, (b1, b2), lr = p.grad, group["betas"], group["lr"]
            state["step"] += 1
            step = float(state["step"])
            state["exp_avg"].lerp_(g, 1 - b1)
            state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            p.mul_(1 - lr * group["weight_decay"])
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - b2**step)).add_(group["eps"])
            p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1**step))

    return Muon
