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

Tensor and pipeline parallelism (`parallel.tp`, `parallel.pp`) run on the
run's device mesh (trainlab.train.parallel.mesh): `apply_layout` cuts the model into
this rank's pipeline stages (trainlab.train.parallel.pipeline), shards each over the
tp dimension (trainlab.train.parallel.tensor), then recomputation, then FSDP2
over the dp dimension (2-D / 3-D: parameters become DTensors on the
(dp, tp) submesh). Beside tp or pp > 1, DDP is FSDP2's `replicate` over the
dp dimension (gradients all-reduced; it composes with DTensor parameters where
DistributedDataParallel does not); ZeRO-1 is refused there by the config rules.

Activation checkpointing: `full` recomputes every block in backward,
`selective` every other block (layer-wise selective, as in torchtitan).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from trainlab.config.schema import ExperimentConfig
from trainlab.errors import UserError
from trainlab.train.parallel.distributed import DistEnv


def check_executable(cfg: ExperimentConfig) -> None:
    """Refuse a config whose layout is not resolved, before any worker starts.
    (A layout the trainer cannot execute is refused at validation: the config
    rules ask trainlab.config.dims.layout_executes.)"""
    if cfg.parallel.strategy not in ("ddp", "fsdp"):
        raise UserError(
            f"parallel.strategy = {cfg.parallel.strategy!r}: resolve the layout first "
            "(trainlab.plan.resolve_layout)"
        )


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = model.layers
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Recompute blocks (the elements of `model.layers`) in backward."""
    if mode == "none" or not _blocks(model):
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    every = 1 if mode == "full" else 2
    chosen = {id(b) for i, b in enumerate(_blocks(model)) if i % every == 0}
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
        _fully_shard(model, cfg, env.mesh["dp"] if env.mesh is not None else None)
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def _fully_shard(model: nn.Module, cfg: ExperimentConfig, mesh: Any) -> None:
    """FSDP2 per block, then the rest at the root, over `mesh` (None: the world)."""
    from torch.distributed.fsdp import fully_shard

    reshard = cfg.parallel.zero_stage == 3
    policy = fsdp_mixed_precision(cfg.train.precision)
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)


def _replicate(model: nn.Module, mesh: Any) -> None:
    """DDP (ZeRO-0) over `mesh`: gradients all-reduced, per block then the rest."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in _blocks(model):
        replicate(block, mesh=mesh)
    replicate(model, mesh=mesh)


@dataclass
class ParallelModel:
    """A rank's model as its layout holds it: `parts` is the (wrapped) model, or
    this rank's pipeline stages; `pipeline` drives them (None without pp)."""

    parts: list[nn.Module]
    pipeline: Any = None  # trainlab.train.parallel.pipeline.PipelinePlan
    tensor_parallel: bool = False

    @property
    def sharded(self) -> bool:
        """Whether parameters are split over ranks (checkpoints are then DCP)."""
        return self.pipeline is not None or self.tensor_parallel


def apply_layout(model: nn.Module, cfg: ExperimentConfig, env: DistEnv) -> ParallelModel:
    """`model` (the whole model, built from the run's seed, on env.device) as this
    rank's part of the layout."""
    layout = env.layout
    if env.mesh is None or not layout.model_parallel:
        return ParallelModel([apply_parallelism(model, cfg, env)])
    from trainlab.train.parallel.pipeline import PipelinePlan, split_model, tied_groups
    from trainlab.train.parallel.tensor import apply_tensor_parallel

    p = cfg.parallel
    pp_rank = env.coords.pp
    pipeline = None
    if layout.pp > 1:
        virtual = p.pp_virtual_stages or 1
        parts, ids, num_stages = split_model(model, pp_rank, layout.pp, virtual)
        tied = tied_groups(layout, cfg.model.tie_embeddings, num_stages)(env.rank)
        pipeline = PipelinePlan(
            stages=parts,
            stage_ids=ids,
            num_stages=num_stages,
            schedule_name=p.pp_schedule,
            microbatches=cfg.pipeline_microbatches or layout.pp,
            pp_rank=pp_rank,
            pp=layout.pp,
            group=env.group("pp"),
            tied_group=tied,
        )
    else:
        parts = [model]
    for part in parts:
        if layout.tp > 1:
            apply_tensor_parallel(part, env.mesh["tp"], p.sequence_parallel)
        apply_activation_checkpointing(part, p.activation_checkpointing)
        if layout.dp > 1 and p.strategy == "fsdp":
            _fully_shard(part, cfg, env.mesh["dp"])
        elif layout.dp > 1:  # DDP beside tp/pp: FSDP2's replicate (composes with DTensor)
            _replicate(part, env.mesh["dp"])
    if pipeline is not None:
        pipeline.build_schedule(env.device)
    return ParallelModel(parts, pipeline, layout.tp > 1)


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


def clip_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    pp_group: Any = None,
    exclude: frozenset[int] = frozenset(),
) -> float:
    """Clip the gradients of `params` (this rank's; any mix of plain tensors and
    DTensors on different meshes) by their global norm, summed over pipeline ranks
    through `pp_group`; parameters whose id is in `exclude` (a tied table's second
    copy) are clipped but not counted. Returns the norm before clipping."""
    import torch.distributed as dist

    with_grad = [p for p in params if p.grad is not None]
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for p in with_grad:
        if id(p) in exclude:
            continue
        g = p.grad
        mesh = getattr(g, "device_mesh", None)
        by_kind.setdefault((id(mesh), tuple(getattr(g, "placements", ()))), []).append(g)
    device = with_grad[0].grad.device if with_grad else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float32, device=device)
    for grads in by_kind.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        square = square + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(square, group=pp_group)
    total = float(square.sqrt())
    if math.isfinite(max_norm) and total > max_norm:
        coef = max_norm / (total + 1e-6)
        for p in with_grad:
            p.grad.mul_(coef)
    return total


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


def build_optimizer(model: nn.Module, cfg: ExperimentConfig, env: DistEnv) -> torch.optim.Optimizer:
    """The configured optimizer (train.optimizer, trainlab.optim) over `model`: one
    per pipeline stage; ZeRO-1 shards its state (only without tp/pp)."""
    return cfg.train.optimizer.build(model, cfg.train.lr, zero1=uses_zero1(cfg, env))


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
