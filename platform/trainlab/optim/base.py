"""What every optimizer tells trainlab about itself (trainlab.optim).

An optimizer is a config class: its fields (typed, bounded, `extra="forbid"`),
`build()`, which makes the torch optimizer over one model part, and the figures
the planner and the checkpoint-size preflight read (`memory`,
`checkpoint_bytes_per_param`). No optimizer byte count lives anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class PlanParam:
    """One parameter tensor as the planner sees it on one rank."""

    name: str
    shape: tuple[int, ...]  # the whole tensor's shape, before any sharding
    layer: int | None  # index of its block in `model.layers`; None: embeddings, head, final norm
    local: float  # elements this rank holds and steps (after tp/pp split and ZeRO/FSDP shards)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def sharded(self) -> bool:
        return self.local < self.numel


@dataclass(frozen=True)
class StepMemory:
    """Bytes on one device: the optimizer's state, kept between steps, and the
    largest set of temporaries its `step()` allocates at once."""

    state: float
    step_temporary: float


class OptimizerConfig(BaseModel):
    """Base of every optimizer's config section (`train.optimizer`). A subclass
    gives `name` as a `Literal` with that name as its default."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    name: str

    # ----------------------------------------------------------------- training

    def build(self, model: nn.Module, lr: float, zero1: bool = False) -> torch.optim.Optimizer:
        """The optimizer over `model`'s trainable parameters (one model part: the
        whole model, or one pipeline stage), at learning rate `lr` (the schedule
        sets each step's). `zero1`: shard the state over the data-parallel ranks
        with torch's ZeroRedundancyOptimizer (DDP, ZeRO stage 1)."""
        raise NotImplementedError

    def create_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Create the state that exists from the second step on, without a step
        (the memory trace counts it before tracing a step). Default: nothing, the
        traced step creates it and it is still counted."""

    # ----------------------------------------------------------------- planning

    def memory(self, params: list[PlanParam], gpu: bool) -> StepMemory:
        """State and step temporaries for the parameters one rank steps."""
        raise NotImplementedError

    def plan_groups(self, params: list[PlanParam]) -> list[list[PlanParam]]:
        """`params` in the parameter groups `build()` makes, in its order (ZeRO-1
        partitions group by group). Default: decayed matrices, then the rest."""
        return [
            g
            for g in ([p for p in params if len(p.shape) >= 2], [p for p in params if len(p.shape) < 2])
            if g
        ]

    def checkpoint_bytes_per_param(self, params: list[PlanParam]) -> float:
        """Bytes per model parameter of one checkpoint of the model state: the
        fp32 weights and this optimizer's state, over the whole model (`params`
        unsharded)."""
        whole = [PlanParam(p.name, p.shape, p.layer, float(p.numel)) for p in params]
        total = sum(p.numel for p in whole)
        return 4 + self.memory(whole, gpu=False).state / max(total, 1)


def decay_groups(params: list[Any], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (and embeddings), none on norms and biases; no
    empty groups (a pipeline stage may hold no parameters of a kind, and an empty
    group's state cannot be named by parameter, which resharding needs)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def trainable(model: nn.Module) -> list[Any]:
    return [p for p in model.parameters() if p.requires_grad]
