"""Parallelism and memory techniques, applied to a model from outside.

The model file knows nothing of these. Strategies (parallel.strategy after
`resolve_layout`) and ZeRO stages:

- ddp, zero_stage 0: DistributedDataParallel (full replicas, gradient all-reduce).
- ddp, zero_stage 1: DDP + ZeroRedundancyOptimizer (optimizer state sharded).
- fsdp, zero_stage 2: FSDP2 `fully_shard(reshard_after_forward=False)`: gradients
  and optimizer state sharded, parameters kept gathered between forward and
  backward (SHARD_GRAD_OP).
- fsdp, zero_stage 3: FSDP2 `fully_shard(reshard_after_forward=True)`:
  everything sharded (FULL_SHARD).

Precision: fp32 trains fp32 everywhere. bf16/fp16 under DDP and ZeRO-1 is
`torch.autocast` over fp32 weights (weights, gradients, DDP's gradient buckets
and Adam's two moments all fp32); under FSDP it is a `MixedPrecisionPolicy`
(fp32 sharded weights, gradients and optimizer state; 16-bit all-gathered
parameters for compute; fp32 gradient reduction), see `fsdp_mixed_precision`.

Activation checkpointing: `full` recomputes every block in backward,
`selective` every other block (layer-wise selective, as in torchtitan).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
from torch import nn

from trainlab.config.schema import ExperimentConfig, TrainConfig
from trainlab.errors import UserError
from trainlab.train.distributed import DistEnv


def check_executable(cfg: ExperimentConfig) -> None:
    """Refuse a config whose layout is not resolved, before any worker starts.
    (Layouts this version cannot execute, tp/pp > 1 and sequence parallelism, are
    refused by the config rules at validation.)"""
    if cfg.parallel.strategy not in ("ddp", "fsdp"):
        raise UserError(
            f"parallel.strategy = {cfg.parallel.strategy!r}: resolve the layout first "
            "(trainlab.plan.resolve_layout)"
        )


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Recompute blocks (the elements of `model.layers`) in backward."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    every = 1 if mode == "full" else 2
    chosen = {id(b) for i, b in enumerate(model.layers) if i % every == 0}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda m: id(m) in chosen,
    )


def apply_parallelism(model: nn.Module, cfg: ExperimentConfig, env: DistEnv) -> nn.Module:
    """Wrap `model` (already on env.device) for the configured strategy."""
    apply_activation_checkpointing(model, cfg.parallel.activation_checkpointing)
    if not env.distributed:
        return model
    if cfg.parallel.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        reshard = cfg.parallel.zero_stage == 3
        policy = fsdp_mixed_precision(cfg.train.precision)
        for block in model.layers:
            fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def fsdp_mixed_precision(precision: str):  # -> MixedPrecisionPolicy
    """FSDP2's precision: the sharded master weights, gradients and optimizer state
    stay fp32; each block's parameters are all-gathered in bf16/fp16 for forward
    and backward, and gradients are reduce-scattered in fp32. (Autocast still runs
    around the step, for the few ops outside the parameters' dtype.)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP (FSDP2 shards in place and needs no unwrapping)."""
    return model.module if hasattr(model, "module") else model


def uses_zero1(cfg: ExperimentConfig, env: DistEnv) -> bool:
    return env.distributed and cfg.parallel.strategy == "ddp" and cfg.parallel.zero_stage == 1


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (and embeddings), none on norms and biases."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: ExperimentConfig, env: DistEnv) -> torch.optim.Optimizer:
    t: TrainConfig = cfg.train
    kwargs = {"lr": t.lr, "betas": (t.beta1, t.beta2), "eps": t.eps}
    groups = param_groups(model, t.weight_decay)
    if uses_zero1(cfg, env):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            groups[0]["params"],
            optimizer_class=torch.optim.AdamW,
            weight_decay=t.weight_decay,
            **kwargs,
        )
        opt.add_param_group(groups[1])
        return opt
    return torch.optim.AdamW(groups, **kwargs)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """DDP: skip the gradient all-reduce on all but the last micro batch (the
    gradients accumulate unsharded either way). FSDP reduce-scatters after every
    micro batch, so only sharded gradients are ever kept: skipping it would hold
    every layer's full fp32 gradients through the accumulation, which is what
    ZeRO-2/3 exist to avoid; the price is one reduce-scatter per micro batch."""
    if enabled or not hasattr(model, "no_sync"):
        yield
    else:
        with model.no_sync():
            yield
