"""Parallelism and memory techniques, applied to a model from outside.

The model file knows nothing of these. `parallelize` is the one function that
applies them, one module per technique, in this order (torchtitan's):

    pipeline   cut the model into this rank's stages (parallel.pp)
    tensor     shard each stage over the tp mesh (parallel.tp, sequence_parallel)
    recompute  activation checkpointing (parallel.activation_checkpointing)
    compile    torch.compile of each block (train.compile)
    fsdp       FSDP2 over the dp mesh (ZeRO-2/3)   | one of the two, by
    replicate  DDP / FSDP2's replicate (ZeRO-0/1)  | parallel.strategy

A new technique is a module here with an `apply`, its step in `parallelize`,
and its config field and rule (trainlab.config: schema, rules, dims). The run's
dimensions are `env.layout` (trainlab.config.dims.ParallelDims), the mesh
`env.mesh` with named dimensions (trainlab.train.parallel.mesh).

Precision: fp32 trains fp32 everywhere. bf16/fp16 under DDP and ZeRO-1 is
`torch.autocast` over fp32 weights (weights, gradients, DDP's gradient buckets
and the optimizer state fp32); under FSDP it is a `MixedPrecisionPolicy`
(trainlab.train.parallel.fsdp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainlab.config.schema import ExperimentConfig
from trainlab.errors import UserError
from trainlab.models.registry import arch_of
from trainlab.train.parallel import compile as compiling
from trainlab.train.parallel import fsdp, recompute, replicate
from trainlab.train.parallel.distributed import DistEnv
from trainlab.train.parallel.fsdp import mixed_precision as fsdp_mixed_precision
from trainlab.train.parallel.fsdp import reshard
from trainlab.train.parallel.replicate import gradient_sync, unwrap

__all__ = [
    "ParallelModel",
    "apply_parallelism",
    "build_optimizer",
    "check_executable",
    "clip_grad_norm",
    "fsdp_mixed_precision",
    "gradient_sync",
    "parallelize",
    "reshard",
    "unwrap",
    "uses_zero1",
]


def check_executable(cfg: ExperimentConfig) -> None:
    """Refuse a config whose layout is not resolved, before any worker starts.
    (A layout the trainer cannot execute is refused at validation: the config
    rules ask trainlab.config.dims.layout_executes.)"""
    if cfg.parallel.strategy not in ("ddp", "fsdp"):
        raise UserError(
            f"parallel.strategy = {cfg.parallel.strategy!r}: resolve the layout first "
            "(trainlab.plan.resolve_layout)"
        )


@dataclass
class ParallelModel:
    """A rank's model as its layout holds it: `parts` is the (wrapped) model, or
    this rank's pipeline stages; `pipeline` drives them (None without pp)."""

    parts: list[nn.Module]
    pipeline: Any = None  # trainlab.train.parallel.pipeline.PipelinePlan
    tensor_parallel: bool = False
    # Expert parallelism's state (trainlab.train.parallel.expert.EPState), None without.
    experts: Any = None

    @property
    def sharded(self) -> bool:
        """Whether parameters are split over ranks by tp, pp or ep."""
        return self.pipeline is not None or self.tensor_parallel or self.experts is not None


def parallelize(model: nn.Module, cfg: ExperimentConfig, env: DistEnv) -> ParallelModel:
    """`model` (the whole model, built from the run's seed, on env.device) as this
    rank's part of the layout: each technique of the module docstring in turn."""
    p, dims = cfg.parallel, env.layout
    fsdp_on = p.strategy == "fsdp"
    compiled = compiling.enabled(cfg.train.compile, env.device.type)
    if env.mesh is None or not dims.model_parallel:  # data parallelism at most
        recompute.apply(model, p.activation_checkpointing)
        if compiled:
            compiling.apply(model)
        if not env.distributed:
            return ParallelModel([model])
        experts = None
        if (p.ep or 1) > 1:  # the experts split over ep ranks; DDP or FSDP for the rest
            from trainlab.train.parallel import expert

            experts = expert.apply(model, p.ep, dims.dp, env.device.type, dims.pp, dims.tp)
        if fsdp_on:
            mesh = env.mesh["dp"] if env.mesh is not None else None
            ignored = experts.params(model) if experts is not None else None
            fsdp.apply(model, p.zero_stage, cfg.train.precision, mesh, ignored)
            return ParallelModel([model], experts=experts)
        if experts is not None:
            model = replicate.ignore(model, experts.param_names)
        return ParallelModel([replicate.ddp(model, env.device)], experts=experts)
    from trainlab.train.parallel import pipeline as pipelining
    from trainlab.train.parallel import tensor

    plan = None
    parts = [model]
    tp_plan = arch_of(cfg.model).tensor_parallel_plan(cfg.model)
    if dims.pp > 1:
        pp_rank = env.coords.pp
        virtual = p.pp_virtual_stages or 1
        parts, ids, num_stages = pipelining.split_model(model, pp_rank, dims.pp, virtual)
        tied = pipelining.tied_groups(dims, cfg.model.tie_embeddings, num_stages)(env.rank)
        plan = pipelining.PipelinePlan(
            stages=parts,
            stage_ids=ids,
            num_stages=num_stages,
            schedule_name=p.pp_schedule,
            microbatches=cfg.pipeline_microbatches or dims.pp,
            pp_rank=pp_rank,
            pp=dims.pp,
            group=env.group("pp"),
            tied_group=tied,
        )
    experts = None
    if (p.ep or 1) > 1:  # the experts split over ep dp ranks at each (pp, tp) coordinate
        from trainlab.train.parallel import expert

        # on the whole model: the rules refuse pp with model.moe (parts == [model])
        experts = expert.apply(model, p.ep, dims.dp, env.device.type, dims.pp, dims.tp)
    for part in parts:
        ignored = experts.params(part) if experts is not None else None
        if dims.tp > 1 and tp_plan is not None:  # the architecture's own plan
            tensor.apply_plan(part, env.mesh["tp"], tp_plan)
        elif dims.tp > 1:
            tensor.apply_tensor_parallel(part, env.mesh["tp"], p.sequence_parallel)
        recompute.apply(part, p.activation_checkpointing)
        if compiled:
            compiling.apply(part)
        if dims.dp > 1 and fsdp_on:
            fsdp.apply(part, p.zero_stage, cfg.train.precision, env.mesh["dp"], ignored)
        elif dims.dp > 1:
            replicate.apply(part, env.mesh["dp"], ignored)
    if plan is not None:
        plan.build_schedule(env.device)
    return ParallelModel(parts, plan, dims.tp > 1, experts)


def apply_parallelism(model: nn.Module, cfg: ExperimentConfig, env: DistEnv) -> nn.Module:
    """A data-parallel layout's wrapped model (the memory trace's entry: no tp/pp)."""
    return parallelize(model, cfg, env).parts[0]


def clip_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    pp_group: Any = None,
    exclude: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """Clip the gradients of `params` (this rank's; any mix of plain tensors and
    DTensors on different meshes) by their global norm, summed over pipeline ranks
    through `pp_group`; parameters whose id is in `exclude` (a tied table's second
    copy) are clipped but not counted. Returns the norm before clipping, a 0-dim
    tensor on the device: nothing is read back (the factor is clamped to 1 on the
    device, as torch.nn.utils.clip_grad_norm_ does)."""
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
    total = square.sqrt()
    if math.isfinite(max_norm):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for p in with_grad:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total


def uses_zero1(cfg: ExperimentConfig, env: DistEnv) -> bool:
    return env.distributed and cfg.parallel.strategy == "ddp" and cfg.parallel.zero_stage == 1


def build_optimizer(model: nn.Module, cfg: ExperimentConfig, env: DistEnv) -> torch.optim.Optimizer:
    """The configured optimizer (train.optimizer, trainlab.optim) over `model`: one
    per pipeline stage; ZeRO-1 shards its state (only without tp/pp)."""
    return cfg.train.optimizer.build(model, cfg.train.lr, zero1=uses_zero1(cfg, env))
