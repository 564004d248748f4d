"""FSDP2 (ZeRO-2/3, `parallel.strategy: fsdp`): `fully_shard` per block, then the
rest at the root, over the data-parallel mesh. ZeRO-2 keeps parameters gathered
between forward and backward (`reshard_after_forward=False`, SHARD_GRAD_OP);
ZeRO-3 reshards them (FULL_SHARD).

Precision: fp32 trains fp32 everywhere; bf16/fp16 is a `MixedPrecisionPolicy`
(fp32 sharded weights, gradients and optimizer state; 16-bit all-gathered
parameters for compute; fp32 gradient reduction)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainlab.train.parallel.blocks import blocks


def apply(
    model: nn.Module,
    zero_stage: int,
    precision: str,
    mesh: Any,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    """Shard `model` over `mesh` (None: the world), leaving the parameters
    `ignored` alone (expert parallelism's experts: sharded and synced by
    trainlab.train.parallel.expert)."""
    from torch.distributed.fsdp import fully_shard

    reshard = zero_stage == 3
    policy = mixed_precision(precision)
    for block in blocks(model):
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=reshard,
            mp_policy=policy,
            ignored_params=ignored,
        )
    fully_shard(
        model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, ignored_params=ignored
    )


def mixed_precision(precision: str):  # -> MixedPrecisionPolicy
    """FSDP2's precision: the sharded master weights, gradients and optimizer state
    stay fp32; each block's parameters are all-gathered in bf16/fp16 for forward
    and backward, and gradients are reduce-scattered in fp32. (Autocast still runs
    around the step, for the few ops outside the parameters' dtype.)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def reshard(parts: list[nn.Module]) -> None:
    """Put FSDP2 modules (fully_shard / replicate) back in their sharded state after
    a forward without backward (evaluation): a forward that keeps parameters
    gathered (ZeRO-2, replicate) would otherwise leave the gathered ones
    registered, which is not what the optimizer and checkpoints refer to."""
    from torch.distributed.fsdp import FSDPModule

    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
