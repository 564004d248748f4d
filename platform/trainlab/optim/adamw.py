"""AdamW (Loshchilov & Hutter, decoupled weight decay): the default optimizer.

State per parameter: exp_avg and exp_avg_sq in fp32 (8 bytes per element) and a
4-byte `step` per tensor.

The step runs torch's fused kernel (`fused=True`) wherever the parameters'
device has one (CUDA; CPU too in torch 2.13): the update of a whole group in
a few kernels, in place (no temporaries), with the step count on the device
(the per-tensor loop reads it back each step) and the grad scaler's scale and
inf flags taken as tensors (torch.amp.GradScaler skips its host read for a
fused optimizer). The same results as the per-tensor loop within float
rounding (tests/unit/optim). Where no fused kernel exists torch's default
runs: `foreach` on CUDA makes sqrt(exp_avg_sq) of a whole parameter group at
once (4 bytes per element of the larger group), the per-tensor loop two
temporaries of one tensor at a time (8 bytes per element of the largest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from trainlab.optim import register_optimizer
from trainlab.optim.base import OptimizerConfig, PlanParam, StepMemory, decay_groups, trainable

if TYPE_CHECKING:
    import torch
    from torch import nn


# Devices with torch's fused AdamW kernel, for the planner (torch-free): CUDA, and
# CPU since torch 2.4. `fused_available` asks torch itself at build time.
FUSED_DEVICES = ("cuda", "cpu")


def fused_available(params: list) -> bool:
    """Whether torch's fused AdamW runs on all of `params`: floating point, on a
    device it has the kernel for, and all plain tensors or all DTensors (the
    fused op refuses a mix: a tensor-parallel GPT-2 keeps its position table,
    a matrix that decays with the sharded ones, plain)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    kinds = {hasattr(p, "device_mesh") for p in params}  # DTensor or plain
    return (
        bool(params)
        and len(kinds) == 1
        and all(p.is_floating_point() and p.device.type in devices for p in params)
    )


def mixed_kinds(params: list) -> bool:
    """Whether `params` mixes plain tensors and DTensors."""
    return len({hasattr(p, "device_mesh") for p in params}) > 1


@register_optimizer
class AdamWConfig(OptimizerConfig):
    name: Literal["adamw"] = "adamw"
    # Decoupled weight decay on matrices and embeddings (none on norms and biases).
    weight_decay: float = Field(0.1, ge=0.0, le=10.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, gt=0, le=1e-2)

    def build(self, model: nn.Module, lr: float, zero1: bool = False) -> torch.optim.Optimizer:
        import torch

        kwargs = {"lr": lr, "betas": (self.beta1, self.beta2), "eps": self.eps}
        groups = decay_groups(trainable(model), self.weight_decay)
        # Fused per parameter group (the kernel takes a group at once): every group
        # where it runs; the default too when all do (what the grad scaler asks).
        for group in groups:
            group["fused"] = fused_available(group["params"])
            if not group["fused"] and mixed_kinds(group["params"]):
                # torch's default on CUDA, `foreach`, refuses a mix of plain tensors
                # and DTensors too (expert parallelism under DDP: the routed experts
                # are DTensors, decaying with the dense matrices): the per-tensor loop
                group["foreach"] = False
        if all(group["fused"] for group in groups):
            kwargs["fused"] = True
        if zero1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                groups[0]["params"],
                optimizer_class=torch.optim.AdamW,
                weight_decay=groups[0]["weight_decay"],
                **kwargs,
            )
            for group in groups[1:]:
                opt.add_param_group(group)
            return opt
        return torch.optim.AdamW(groups, **kwargs)

    def create_state(self, optimizer: torch.optim.Optimizer) -> None:
        """As AdamW's first step creates it (torch.optim.adamw `_init_group`), for
        the parameters this rank steps (ZeroRedundancyOptimizer: its partition)."""
        import torch

        local = getattr(optimizer, "optim", optimizer)
        for group in local.param_groups:
            for p in group["params"]:
                if not p.requires_grad or local.state.get(p):
                    continue
                state = local.state[p]
                # fused: the step count on the parameter's device (torch's _init_group)
                fused = group.get("fused") or False
                state["step"] = (
                    torch.zeros((), dtype=torch.float32, device=p.device)
                    if fused
                    else torch.tensor(0.0, dtype=torch.float32)
                )
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def memory(self, params: list[PlanParam], gpu: bool) -> StepMemory:
        state = 8 * sum(p.local for p in params) + 4 * len(params)
        if ("cuda" if gpu else "cpu") in FUSED_DEVICES:  # fused: in place, no temporaries
            return StepMemory(state, 0.0)
        if gpu:  # foreach: one temporary per element of the larger group
            decay = sum(p.local for p in params if len(p.shape) >= 2)
            no_decay = sum(p.local for p in params if len(p.shape) < 2)
            temp = 4 * max(decay, no_decay)
        else:  # the per-tensor loop: two temporaries of one tensor
            temp = 8 * max((p.local for p in params), default=0.0)
        return StepMemory(state, temp)
