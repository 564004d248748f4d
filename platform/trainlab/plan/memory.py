"""Memory per device of the trainer's training step, by category: the planner's model.

It counts what trainlab's trainer allocates (trainlab.train: `parallel`, `step`,
`state`, `checkpointer`; trainlab.models: `layers`), not what the papers'
idealized programs do. Torch-free and fast; checked against a trace of the real
step at full size (`trainlab.train.memtrace`, tests/unit/train/test_memtrace.py).

Model state per device, bytes per parameter (P parameters, d = dp), bf16 and fp32
alike unless said:

| strategy | parameters | gradients | optimizer (AdamW; others: trainlab.optim) | communication |
|---|---|---|---|---|
| one device | 4 | 4 | 8 | - |
| DDP (zero 0) | 4 | 4 | 8 | 4 (gradient buckets) |
| ZeRO-1 (DDP + ZeroRedundancyOptimizer) | 4 | 4 | 8/d (rank 0's greedy share) | 4 |
| FSDP2 ZeRO-2/3 | 4/d (row-padded shards) + 2 (4 in fp32) per gathered parameter | 4/d | 8/d | 2-4 per parameter of the block prefetched / reduce-scattered |

plus, during the optimizer step, nothing more: AdamW runs torch's fused kernel
(CUDA and CPU), in place; where a device has none, `foreach`'s sqrt(exp_avg_sq) of
the larger parameter group (4 per parameter of it; CUDA). A 4-byte step per tensor.
Each optimizer states its own state and step figures (`memory` in
trainlab.optim's modules; Muon: 4 bytes per hidden-matrix element, AdamW's 8 for
the rest, and one matrix's Newton-Schulz working set during the step).
FSDP gathers (16-bit with mixed precision) the root group (embeddings, final
norm, output) and one block at a time, the next block prefetched; ZeRO-2 keeps
every block gathered from its forward to its backward.

Precision: fp32 runs fp32 everywhere. bf16/fp16 under DDP is `torch.autocast`
over fp32 weights: weights, gradients, buckets and Adam stay fp32; autocast
keeps a 16-bit copy of every Linear weight from forward until that block's
backward (2 bytes per matmul parameter; cached for the whole forward, so a
recomputed block's too); the residual stream stays fp32 and every Linear casts
its own 16-bit copy of its input. bf16/fp16 under FSDP is its mixed-precision
policy: fp32 shards, 16-bit gathered parameters and residual stream, fp32
gradient reduce-scatter; its input casting also gives every block its own
16-bit RoPE tables (the attention mask is built once before the blocks and its
tensors are shared: FSDP's per-block copies of its dataclass hold the same mask).

Activations are what autograd saves, per block and token, as the architecture
states it (`Architecture.block_saved_bytes`): the norms' inputs and outputs, the
qkv output, q and k after RoPE, the attention output, the kernel's log-sum-exp
and, on the `sdpa` path, the packed batch's block-diagonal mask converted to the
compute dtype (T bytes x 2-4 per token, per block: SDPA converts it on each call),
the MLP's ffn-wide tensors. The `flex` path (`model.attention: auto` on CUDA,
docs/gpu.md) keeps no mask: FlexAttention's block mask is a few bytes per pair of
128-token blocks. The planner resolves `auto` for the device (`resource.use_gpu`).
E.g. Llama per token: fp32 36h + 12kv + 16f, DDP bf16
32h + 6kv + 8f, FSDP bf16 22h + 6kv + 8f (+ 4 x heads, + c x T on the sdpa path). `full`
recomputation keeps each block's input only and rebuilds one block at a time
in backward; `selective` does that for every other block and keeps, in those, the
attention kernel's output and log-sum-exp (c x h + 4 x heads per token).

The loss (`train.loss_chunk_tokens`, trainlab.models.loss): the logits [tokens,
vocab] in the compute dtype, kept from forward to the output projection's
backward (the chunked loss writes their gradient over them), plus one chunk's
fp32 working set at a time (its fp32 copy, none in fp32, and its exponentials:
8 x chunk x vocab bytes in bf16), forward and backward. Under tensor parallelism
the vocabulary-sharded logits go through torch's `loss_parallel`: `.float()` and
the log-softmax kept, 10 bytes per logit in forward (8 in fp32), 12 at the start
of backward. Tied
embeddings: the output's gradient waits in autograd's input buffer until the
embedding's arrives and the two are summed out of place.

The peak is the largest of the step's high-water marks, each counted in full:
the end of forward, the loss's backward, the output projection's backward, the
backward of each block (its saved tensors, its backward working set, gradients
so far, FSDP's gathered parameters, the prefetched block's all-gather buffer and
the previous block's reduce-scatter buffer), FSDP's reduce-scatter of each
block, the embedding's backward, the root's reduce-scatter, and the optimizer
step. Steady state: the optimizer state exists before the step, gradients do
not (zero_grad(set_to_none=True)); with gradient accumulation the last micro
batch starts with the accumulated gradients (DDP: full, in .grad; FSDP
reduce-scatters every micro batch: shards).

`framework` is a constant for what no tensor shows: the CUDA context and its
kernels (~0.5 GiB on H100-class GPUs), cuBLAS/cuDNN workspaces and NCCL's
communicator buffers (~0.25 GiB each): 1 GiB on GPU. On CPU workers, the
Python process with torch loaded: 0.5 GiB. Allocator fragmentation is left to
the planner's safety margin.

`checkpoint_snapshot`: 0. Every layout checkpoints through
torch.distributed.checkpoint; with `train.checkpoint.async_save` its async save
stages the state to host memory and writes from there: nothing is copied on the
device. (On a CPU worker that staging copy is host memory too; the plan does not
count it, as the resident-set figures in the run record show.)

Tensor and pipeline parallelism (trainlab.train.parallel.tensor, .pipeline):
the estimate divides the model state by tp*pp and the blocks' internal
activations by tp (norms and residual replicated without sequence
parallelism), and holds pp micro batches of L/pp layers on the first stage
(1F1B). It is the paper model. `trainlab plan --trace` traces tp and pp layouts
too (every pipeline rank; the busiest compared); on the tiny recipe the
tensors are off by more than the data-parallel 10%: tp=2 -15% (DDP buckets no
tp layout has, loss_parallel's logits), pp=2 +73% (the P/pp split, the data
micro batch taken as the pipeline's, no gradients at the last stage's forward
peak) (tests/unit/train/test_memtrace.py, docs/memory.md).

Mixture of experts (`model.moe`: trainlab.models.moe; `parallel.ep`:
trainlab.train.parallel.expert). An MoE layer keeps, in place of the dense MLP's
tensors, its router's scores and choices and, per (token, expert) row, its
dispatch buffers: the sorted rows, the grouped experts' four expert-wide
tensors, their output in fp32 and the weighted rows (`_moe_layer_bytes`); the
last MoE layer's forward is a high-water mark of its own (the combine's
transient buffers). Expert parallelism (ep > 1, dp2ep): each device holds
num_experts/ep of every layer's routed experts, whole. DDP and FSDP are told to
leave them alone, so per device their fp32 weights, gradients and optimizer
state are 1/ep of all (FSDP does not shard them further over dp/ep); they are
in no DDP gradient bucket (expert parallelism all-reduces their gradients in
place over edp) and in no FSDP all-gather or reduce-scatter; under FSDP mixed
precision the grouped GEMM casts them to 16 bits, kept for its backward. Under
DDP, AdamW's decayed group mixes tensors and the experts' DTensors, which the
fused kernel refuses: that group steps unfused. A recomputed MoE block
(activation checkpointing) keeps its input like any other; the last MoE layer's
forward mark then adds what its forward still holds at the combine. Checked
against the trace at ep = 1 (bf16, the CUDA grouped-GEMM path) within 1.5% of
the traced tensors, with and without recomputation; ep > 1 is not traced.
Under tensor parallelism an MoE layer's MLP (router, routed and shared experts)
is replicated over the tp ranks (trainlab.train.parallel.tensor): its
parameters, their gradients and optimizer state are divided by pp only, not by
tp*pp (`_replicated_over_tp`), and its activations are not divided by tp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from trainlab.config.schema import ExperimentConfig
from trainlab.models.moe import expert_width, is_moe_layer
from trainlab.models.registry import ParamShape, StepDtypes, arch_of, resolve_attention
from trainlab.optim import PlanParam, StepMemory

__all__ = [
    "CATEGORIES",
    "FRAMEWORK_BYTES",
    "MemoryEstimate",
    "checkpoint_bytes_per_param",
    "estimate_memory",
    "expert_parallel",
    "experts_state_bytes",
    "framework_bytes",
    "layout_config",
    "memory_breakdown",
    "optimizer_memory",
    "step_dtypes",
]

GiB = 1024**3

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer",
    "communication",
    "activations",
    "logits_loss",
    "checkpoint_snapshot",
    "framework",
)

# See the module docstring.
FRAMEWORK_BYTES = 1 * GiB
FRAMEWORK_BYTES_CPU = GiB // 2


def framework_bytes(cfg: ExperimentConfig) -> float:
    return float(FRAMEWORK_BYTES if cfg.resource.use_gpu else FRAMEWORK_BYTES_CPU)


def layout_config(cfg: ExperimentConfig, layout: Any) -> ExperimentConfig:
    """A copy of `cfg` whose `parallel` section and world size are `layout`'s
    (an object with tp, pp, dp, zero_stage, e.g. trainlab.plan.Layout)."""
    strategy = "ddp" if layout.zero_stage <= 1 else "fsdp"
    parallel = cfg.parallel.model_copy(
        update={
            "strategy": strategy,
            "tp": layout.tp,
            "pp": layout.pp,
            "dp": layout.dp,
            "zero_stage": layout.zero_stage,
        }
    )
    world = layout.tp * layout.pp * layout.dp
    resource = cfg.resource.model_copy(update={"num_workers": world})
    return cfg.model_copy(update={"parallel": parallel, "resource": resource})


def step_dtypes(precision: str, fsdp: bool, use_gpu: bool) -> StepDtypes:
    """How the trainer's step stores things (see the module docstring)."""
    if precision == "fp32":
        return StepDtypes(4, 4, False, False, 4, False)
    if fsdp:  # MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32), autocast around
        return StepDtypes(2, 2, False, use_gpu, 2, True)
    return StepDtypes(2, 4, True, use_gpu, 4, False)  # autocast over fp32 weights


@dataclass
class MemoryEstimate:
    """The estimated peak of the busiest device (rank 0), by category, and the
    high-water marks it is the largest of."""

    memory: dict[str, float]  # CATEGORIES + "total", bytes
    phase: str  # the high-water mark that is the peak
    phases: dict[str, float] = field(default_factory=dict)  # total at each mark
    notes: list[str] = field(default_factory=list)
    # each mark by category (CATEGORIES + "total")
    breakdowns: dict[str, dict[str, float]] = field(default_factory=dict)


def memory_breakdown(
    cfg: ExperimentConfig, layout: Any, micro_batch: int, ep: int | None = None
) -> dict[str, float]:
    """Bytes per device at the step's peak, by category, plus `total`.

    `layout`: tp, pp, dp, zero_stage (trainlab.plan.Layout or alike); the
    precision, recomputation, sequence length, device kind, gradient
    accumulation and checkpointing come from `cfg`; expert parallelism from
    `ep`, else `parallel.ep` (`expert_parallel`)."""
    return estimate_memory(cfg, layout, micro_batch, ep).memory


# --------------------------------------------------------------------------- the model


@dataclass
class _Parts:
    """Bytes of one high-water mark by category."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    communication: float = 0.0
    activations: float = 0.0
    logits_loss: float = 0.0
    checkpoint_snapshot: float = 0.0
    framework: float = 0.0

    def plus(self, **more: float) -> _Parts:
        out = _Parts(**self.__dict__)
        for k, v in more.items():
            setattr(out, k, getattr(out, k) + v)
        return out

    @property
    def total(self) -> float:
        return sum(self.__dict__.values())

    def as_dict(self) -> dict[str, float]:
        return {**{k: float(getattr(self, k)) for k in CATEGORIES}, "total": self.total}


def _zero1_share(groups: list[list[PlanParam]], dp: int) -> list[PlanParam]:
    """Rank 0's parameters under ZeroRedundancyOptimizer: per parameter group (in
    the optimizer's order, `OptimizerConfig.plan_groups`), largest first, each to
    the rank with the fewest elements so far (torch's greedy partition; ties to
    the lowest rank)."""
    sizes = [0] * dp
    mine: list[PlanParam] = []
    for group in groups:
        for p in sorted(group, key=lambda p: p.numel, reverse=True):
            rank = sizes.index(min(sizes))
            sizes[rank] += p.numel
            if rank == 0:
                mine.append(p)
    return mine


def _shard(p: ParamShape, dp: int) -> int:
    """Elements of rank 0's FSDP2 shard: dim 0 split in ceil(rows/dp) rows (the last
    ranks padded to it)."""
    rows = p.shape[0]
    return math.ceil(rows / dp) * (p.numel // rows if rows else 0)


# The planner asks about one model many times: its tensors, and per block and dp
# the block's elements (all, rank 0's, gathered with FSDP's row padding, of
# Linear weights), are computed once.
_SHAPES: dict[str, list[ParamShape]] = {}
_BLOCKS: dict[
    tuple[str, int, bool, int, bool],
    tuple[list[int], list[float], list[float], list[float], list[float]],
] = {}


def _param_shapes(cfg: ExperimentConfig) -> list[ParamShape]:
    key = cfg.model.model_dump_json()
    if key not in _SHAPES:
        if len(_SHAPES) > 64:
            _SHAPES.clear()
        _SHAPES[key] = _compute_param_shapes(cfg)
    return _SHAPES[key]


_OPT: dict[tuple[str, str, int, bool, bool, int, bool, int, int], StepMemory] = {}


def optimizer_memory(
    cfg: ExperimentConfig,
    dp: int,
    fsdp: bool,
    zero1: bool,
    mp: int = 1,
    ep: int = 1,
    tp: int = 1,
) -> StepMemory:
    """Rank 0's optimizer state and step temporaries, as the configured optimizer
    counts them (trainlab.optim: each optimizer states its own figures) over the
    parameters rank 0 steps: ZeRO-1's greedy share, FSDP's row-padded shards, the
    tp*pp split (`mp`; the MoE layers' MLP, replicated over `tp`, by mp/tp), and
    with expert parallelism (`ep` > 1) its num_experts/ep routed experts (FSDP
    leaves them alone: not sharded over dp/ep)."""
    gpu = cfg.resource.use_gpu
    opt = cfg.train.optimizer
    key = (cfg.model.model_dump_json(), opt.model_dump_json(), dp, fsdp, zero1, mp, gpu, ep, tp)
    if key not in _OPT:
        if len(_OPT) > 256:
            _OPT.clear()
        shapes = {s.name: s for s in _param_shapes(cfg)}
        whole = [PlanParam(s.name, s.shape, s.layer, s.numel) for s in shapes.values()]
        mine = _zero1_share(opt.plan_groups(whole), dp) if zero1 else whole
        split = {
            name: mp // tp if _replicated_over_tp(cfg, s) else mp for name, s in shapes.items()
        }
        params = [
            PlanParam(
                p.name, p.shape, p.layer, _local(shapes[p.name], dp, fsdp, ep) / split[p.name]
            )
            for p in mine
        ]
        memory = opt.memory(params, gpu)
        if ep > 1 and not fsdp and opt.name == "adamw":
            memory = _mixed_adamw(params, memory, gpu)
        _OPT[key] = memory
    return _OPT[key]


def _mixed_adamw(params: list[PlanParam], memory: StepMemory, gpu: bool) -> StepMemory:
    """AdamW under DDP with expert parallelism: the decayed group mixes plain
    matrices with the experts' DTensors, which neither torch's fused kernel nor
    `foreach` takes (trainlab.optim.adamw: `foreach` off for such a group), so that
    group steps in the per-tensor loop: two temporaries of one tensor, on any device."""
    decay = [p for p in params if len(p.shape) >= 2]
    temp = 8 * max((p.local for p in decay), default=0.0)
    return StepMemory(memory.state, max(memory.step_temporary, temp))


def checkpoint_bytes_per_param(cfg: ExperimentConfig) -> float:
    """Bytes per parameter of one checkpoint: fp32 weights and the optimizer's state."""
    params = [PlanParam(s.name, s.shape, s.layer, s.numel) for s in _param_shapes(cfg)]
    return cfg.train.optimizer.checkpoint_bytes_per_param(params)


def is_routed_expert(p: ParamShape) -> bool:
    """A routed experts' stacked weight of an MoE layer (trainlab.models.moe.experts:
    `layers.i.mlp.experts.{gate,up,down}`, [num_experts, ...])."""
    return p.layer is not None and ".mlp.experts." in p.name


def _replicated_over_tp(cfg: ExperimentConfig, p: ParamShape) -> bool:
    """A parameter of an MoE layer's MLP (router, routed and shared experts),
    which tensor parallelism leaves whole on every tp rank
    (trainlab.train.parallel.tensor)."""
    return p.layer is not None and ".mlp." in p.name and is_moe_layer(cfg.model.moe, p.layer)


def expert_parallel(cfg: ExperimentConfig, layout: Any, ep: int | None = None) -> int:
    """The ep the trainer runs `cfg` with at `layout`: `ep` when given (the planner's
    choice, trainlab.plan.planner.choose_ep), else `layout.ep`, else
    `parallel.ep`; 1 without model.moe, with pp (not run with model.moe) or where
    ep does not divide dp. (With tp the ep groups are the dp ranks at one tp
    coordinate: trainlab.train.parallel.expert.)"""
    if cfg.model.moe is None:
        return 1
    ep = ep or getattr(layout, "ep", None) or cfg.parallel.ep or 1
    if ep <= 1 or layout.pp > 1 or layout.dp % ep:
        return 1
    return ep


def _experts_numel(cfg: ExperimentConfig) -> int:
    """Elements of every MoE layer's routed experts (0 for a dense model)."""
    return sum(p.numel for p in _param_shapes(cfg) if is_routed_expert(p))


def _local(p: ParamShape, dp: int, fsdp: bool, ep: int) -> float:
    """Elements of `p` rank 0 holds and steps: a routed experts' weight under expert
    parallelism its num_experts/ep rows (a Shard(0) DTensor over the ep ranks,
    which DDP and FSDP are told to leave alone: trainlab.train.parallel.expert),
    else FSDP's row-padded shard, else all of it."""
    if ep > 1 and is_routed_expert(p):
        return p.numel / ep
    return float(_shard(p, dp)) if fsdp else float(p.numel)


def _block_sizes(
    cfg: ExperimentConfig, dp: int, fsdp: bool, ep: int = 1, moe_mlp: bool = False
) -> tuple[list[int], list[float], list[float], list[float], list[float]]:
    """Per block: elements; rank 0's elements; FSDP's gathered elements (the
    group's, padded; rank 0's elements without FSDP); rank 0's Linear weights';
    rank 0's routed experts' elements that no FSDP group holds (ep > 1).
    `moe_mlp`: of the MoE layers' MLP parameters only (`_replicated_over_tp`)."""
    key = (cfg.model.model_dump_json(), dp, fsdp, ep, moe_mlp)
    if key not in _BLOCKS:
        if len(_BLOCKS) > 256:
            _BLOCKS.clear()
        shapes = _param_shapes(cfg)
        if moe_mlp:
            shapes = [s for s in shapes if _replicated_over_tp(cfg, s)]
        layers = [[s for s in shapes if s.layer == i] for i in range(cfg.model.num_layers)]
        numel = [sum(s.numel for s in g) for g in layers]
        local = [sum(_local(s, dp, fsdp, ep) for s in g) for g in layers]
        own = [sum(s.numel / ep for s in g if ep > 1 and is_routed_expert(s)) for g in layers]
        if fsdp:  # the experts at ep > 1 are in no FSDP group
            padded = [float(x - o) * dp for x, o in zip(local, own, strict=True)]
        else:
            padded = list(local)
        matmul = [sum(_local(s, dp, False, ep) for s in g if s.matmul) for g in layers]
        _BLOCKS[key] = (numel, local, padded, matmul, own)
    return _BLOCKS[key]


def _compute_param_shapes(cfg: ExperimentConfig) -> list[ParamShape]:
    """The architecture's parameter tensors; one tensor per block and per root part
    when they do not add up to its parameter count (an architecture with other
    shapes than the generic ones)."""
    m = cfg.model
    arch = arch_of(m)
    shapes = arch.param_shapes(m)
    pc = arch.count_params(m)
    if sum(p.numel for p in shapes) == pc.total:
        return shapes
    shapes = [ParamShape("tok_embeddings.weight", (m.vocab_size, m.hidden_size), None)]
    if pc.position:
        shapes.append(ParamShape("pos_embeddings.weight", (pc.position,), None))
    shapes += [ParamShape(f"layers.{i}", (pc.per_layer,), i, True) for i in range(m.num_layers)]
    shapes.append(ParamShape("norm.weight", (pc.final_norm,), None))
    if pc.head:
        shapes.append(ParamShape("output.weight", (pc.head,), None, True))
    return shapes


@dataclass
class _Step:
    """What one training step of one rank holds, by the terms docs/memory.md names;
    computed once (`_step`), read by each phase's high-water marks."""

    cfg: ExperimentConfig
    d: StepDtypes
    tp: int
    mp: int  # tp * pp: the model-parallel split
    dp: int
    fsdp: bool
    zero2: bool
    root: list[ParamShape]  # embeddings, final norm, output: FSDP's root group
    # per block: rank 0's elements, gathered (padded) elements
    layer_local: list[float]
    layer_padded: list[float]
    notes: list[str]
    ep: int = 1  # expert parallelism (trainlab.train.parallel.expert)
    # per block: rank 0's routed experts held outside FSDP's groups (ep > 1)
    layer_own: list[float] = field(default_factory=list)
    persistent: _Parts = field(default_factory=_Parts)  # parameters, optimizer, buckets, framework
    start: _Parts = field(
        default_factory=_Parts
    )  # + the gradients the last micro batch starts with
    carried: float = 0.0
    all_grads: float = 0.0
    opt_temp: float = 0.0  # the optimizer step's temporaries
    # activations
    stored: list[float] = field(default_factory=list)  # per block (recomputed: its input)
    saved: list[float] = field(default_factory=list)  # per block: what it keeps for backward
    work: list[float] = field(default_factory=list)  # per block: its backward working set
    moe_transient: float = 0.0  # an MoE layer's forward dispatch buffers (not kept)
    # what a recomputed MoE block's forward holds at its combine besides its input
    moe_recomputed: float = 0.0
    recomputed: list[bool] = field(default_factory=list)  # per block: checkpointed
    model_saved: float = 0.0
    final_norm: float = 0.0
    mask: float = 0.0
    rope: float = 0.0
    # autocast's 16-bit weight copies (and the MoE experts' own casts)
    copies: list[float] = field(default_factory=list)
    kept_copies: list[float] = field(default_factory=list)
    copy_root: float = 0.0
    gathered: list[float] = field(default_factory=list)  # FSDP's gathered parameters
    gathered_root: float = 0.0
    logits: float = 0.0  # elements of the [tokens, vocab / tp] logits
    loss_chunk: float = 0.0  # the chunked loss's fp32 working set (0: not chunked, tp)
    out_rows: float = 0.0

    def numel(self, ps: list[ParamShape]) -> float:
        return sum(s.numel for s in ps) / self.mp

    def local(self, ps: list[ParamShape]) -> float:  # rank 0's elements of the weights
        return sum(_shard(s, self.dp) for s in ps) / self.mp if self.fsdp else self.numel(ps)

    def padded(self, ps: list[ParamShape]) -> float:  # an FSDP group's unsharded size
        return self.local(ps) * self.dp if self.fsdp else self.numel(ps)


def _step(cfg: ExperimentConfig, layout: Any, micro_batch: int, ep: int | None = None) -> _Step:
    """The step's terms: model state by category, then activations by block."""
    t = cfg.train
    tp, pp, dp, zero = layout.tp, layout.pp, layout.dp, layout.zero_stage
    fsdp = zero >= 2 and dp > 1
    zero1 = zero == 1 and dp > 1
    ddp = tp * pp * dp > 1 and not fsdp
    ep = expert_parallel(cfg, layout, ep)
    d = step_dtypes(t.precision, fsdp, cfg.resource.use_gpu)
    m = cfg.model
    d = replace(d, attention=resolve_attention(m.attention, cfg.resource.use_gpu, m.dropout))
    mp = tp * pp  # model-parallel split (see the module docstring)
    notes = _notes(cfg, mp)
    root = [s for s in _param_shapes(cfg) if s.layer is None]
    # Per block: elements, rank 0's, gathered (padded), of Linear weights, of routed
    # experts outside FSDP's groups.
    layer_numel, layer_local, layer_padded, layer_matmul, layer_own = (
        [x / mp for x in xs] for xs in _block_sizes(cfg, dp, fsdp, ep)
    )
    if tp > 1 and m.moe is not None:  # the MoE layers' MLP: replicated over tp, / pp only
        more = (tp - 1) / mp
        layer_numel, layer_local, layer_padded, layer_matmul, layer_own = (
            [x + y * more for x, y in zip(xs, ys, strict=True)]
            for xs, ys in zip(
                (layer_numel, layer_local, layer_padded, layer_matmul, layer_own),
                _block_sizes(cfg, dp, fsdp, ep, moe_mlp=True),
                strict=True,
            )
        )
    s = _Step(cfg, d, tp, mp, dp, fsdp, fsdp and zero == 2, root, layer_local, layer_padded, notes)
    s.ep, s.layer_own = ep, layer_own
    total_numel = s.numel(root) + sum(layer_numel)
    local_numel = s.local(root) + sum(layer_local)
    # Model state: parameters, the optimizer's state and step temporaries
    # (trainlab.optim), DDP's buckets (gradient_as_bucket_view=False: every
    # parameter but the routed experts at ep > 1, which DDP is told to ignore and
    # expert parallelism all-reduces in place over edp), framework;
    # checkpoint_snapshot 0 (DCP stages to the host).
    opt_memory = optimizer_memory(cfg, dp, fsdp, zero1, mp, ep, tp)
    bucketed = total_numel - (_experts_numel(cfg) / pp if ep > 1 else 0.0)
    s.persistent = _Parts(
        parameters=4 * local_numel,
        optimizer=opt_memory.state,
        communication=4 * bucketed if ddp else 0.0,
        framework=framework_bytes(cfg),
    )
    s.opt_temp = opt_memory.step_temporary
    # Gradients on the device as backward makes them: fp32 (DDP: full; FSDP: shards).
    s.all_grads = 4 * local_numel
    accum = cfg.data.grad_accum_steps or 1
    if accum > 1:
        # DDP (no_sync around the forward) accumulates in .grad. FSDP2: train_step
        # leaves the sync context before backward, so FSDP reduce-scatters every
        # micro batch and accumulates sharded gradients.
        s.carried = s.all_grads
        notes.append(
            f"grad_accum_steps {accum}: the last micro batch starts with the accumulated gradients"
        )
    s.start = s.persistent.plus(gradients=s.carried)
    _activations(s, micro_batch, layer_matmul)
    return s


def _notes(cfg: ExperimentConfig, mp: int) -> list[str]:
    m, notes = cfg.model, []
    if mp > 1:
        notes.append(
            "tp/pp > 1: the paper model, looser than the data-parallel figures: "
            "`trainlab plan --trace` compares it with a trace"
        )
    sdpa = resolve_attention(m.attention, cfg.resource.use_gpu, m.dropout) == "sdpa"
    if cfg.resource.use_gpu and sdpa and (m.num_kv_heads or m.num_heads) != m.num_heads:
        notes.append(
            "grouped-query attention with the packed batch's mask: CUDA SDPA may have no "
            "fused kernel for enable_gqa with an explicit mask and fall back to the math "
            "kernel (attention scores kept, O(seq_len^2) per layer); the estimate assumes "
            "a fused kernel (as the CPU trace runs): check on a GPU"
        )
    return notes


def _activations(s: _Step, micro_batch: int, layer_matmul: list[float]) -> None:
    """Activations per block and token, what a recomputed block keeps, the
    model-level tensors, autocast's weight copies and FSDP's gathered parameters."""
    cfg, d, tp, mp = s.cfg, s.d, s.tp, s.mp
    m = cfg.model
    arch = arch_of(m)
    T = cfg.data.seq_len
    N = micro_batch * T  # tokens per micro batch
    L, V, h = m.num_layers, m.vocab_size, m.hidden_size
    recompute = cfg.parallel.activation_checkpointing  # concrete (the planner resolves "auto")
    ckpt = [recompute == "full" or (recompute == "selective" and i % 2 == 0) for i in range(L)]
    saved_block = arch.block_saved_bytes(m, d, T) * N
    input_block = arch.block_input_bytes(m, d) * N
    if recompute == "selective":  # the recomputed blocks keep the attention's outputs
        input_block += arch.attention_kept_bytes(m, d) * N / tp
    if mp > 1:
        replicated = (2 * arch.norm_saved_bytes(m, d) + arch.block_input_extra_bytes(m, d)) * N
        # pp: the first stage holds pp micro batches of L/pp layers: L layers' worth.
        saved_block = replicated + (saved_block - replicated) / tp
    work_block = arch.block_backward_bytes(m, d, N) / tp
    s.saved, s.work = [saved_block] * L, [work_block] * L
    if m.moe is not None:  # an MoE layer's MLP in place of the dense one
        dense_mlp = (arch.norm_saved_bytes(m, d, arch.mlp_inputs) + arch.mlp_saved_bytes(m, d)) * N
        if tp > 1:  # as saved_block counts it: its norm's output replicated, the rest / tp
            norm = arch.norm_saved_bytes(m, d) * N
            dense_mlp = norm + (dense_mlp - norm) / tp
        moe_saved, moe_work, s.moe_transient, s.moe_recomputed = _moe_layer_bytes(s, N)
        for i in range(L):
            if is_moe_layer(m.moe, i):
                s.saved[i] = saved_block - dense_mlp + moe_saved
                s.work[i] = moe_work
    s.recomputed = ckpt
    s.stored = [input_block if c else x for c, x in zip(ckpt, s.saved, strict=True)]
    # Model-level: RoPE's cos and sin (fp32; FSDP mixed precision gives each block a
    # 16-bit copy, counted in the block), the packed batch's dense bool mask on the
    # sdpa/eager path (built once before the blocks, shared by all and by FSDP's
    # per-block copies of its dataclass; kept by recomputed blocks' arguments, else
    # freed when forward returns; none on the flex path), the final norm, the
    # embedding's dropout mask.
    s.rope = 0.0 if (arch.learned_positions or d.cast_block_inputs) else 2 * 4 * m.head_dim * N
    s.mask = T * N if (any(ckpt) and d.attention != "flex") else 0.0
    s.final_norm = arch.norm_saved_bytes(m, d, 1) * N
    s.model_saved = s.rope + s.mask + s.final_norm + (h * N if m.dropout > 0 else 0)
    # autocast's 16-bit weight copies (DDP/single, 16-bit): cached for the whole
    # forward, then kept by the saved tensors of blocks not recomputed.
    s.copies = [2 * x if d.autocast else 0.0 for x in layer_matmul]
    if s.fsdp and d.compute < 4:
        # FSDP mixed precision with ep > 1: the routed experts, fp32 and in no FSDP
        # group, are cast to 16 bits by the grouped GEMM (kept for its backward).
        s.copies = [c + 2 * own for c, own in zip(s.copies, s.layer_own, strict=True)]
    s.copy_root = 2 * s.numel([p for p in s.root if p.matmul]) if d.autocast else 0.0
    if d.autocast and m.tie_embeddings:
        s.copy_root += 2 * V * h / mp  # the output projection reads the embedding
    s.kept_copies = [0.0 if c else x for c, x in zip(ckpt, s.copies, strict=True)]
    # FSDP: a group's gathered parameters; the root group (embeddings, final norm,
    # output) is gathered for the whole forward and the whole backward.
    pbytes = 2 if (s.fsdp and d.compute == 2) else 4  # FSDP's gathered parameters
    s.gathered = [pbytes * x if s.fsdp else 0.0 for x in s.layer_padded]
    s.gathered_root = pbytes * s.padded(s.root) if s.fsdp else 0.0
    s.logits = N * V / tp
    s.out_rows = V * h / mp
    # The chunked loss (trainlab.models.loss; not under tp: loss_parallel's): one
    # chunk's fp32 working set at a time.
    chunk = cfg.train.loss_chunk_tokens or N
    s.loss_chunk = 0.0 if tp > 1 else float(_chunk_working_bytes(min(chunk, N), V, d.compute))


def _moe_layer_bytes(s: _Step, tokens: int) -> tuple[float, float, float, float]:
    """One MoE layer's MLP part for `tokens` tokens (trainlab.models.moe, dropless
    and balanced: each rank's experts get as many rows as it sends, tokens x
    top_k), as the grouped-GEMM path runs it: what it keeps for backward, with
    its input norm (as Architecture.norm_saved_bytes: under autocast a 16-bit copy
    of the norm's output per Linear reading it, the router's and the shared
    experts' two); its backward's working set; its forward's transient
    dispatch buffers; and what the forward of a recomputed block (activation
    checkpointing: nothing kept) still holds at the combine besides its input
    and those buffers.

    Kept, per token: the router's fp32 scores (4 x num_experts; the sigmoid's
    normalized probabilities' sum 4), its top-k ids (8 x k) and, normalized, the
    chosen weights and their sum (4 x k + 8). Per (token, expert) row, the
    dispatch buffers: the sorted rows in the compute dtype (the grouped GEMM's
    input; under autocast its 16-bit cast of the fp32 rows), the experts' gate
    and up outputs, the SiLU and the product (4 x expert width, compute dtype),
    the experts' output in fp32 (the combine's weighted product keeps
    `y.float()`) and the weighted rows in the compute dtype (`index_copy` keeps
    its source), the row's weight (4), the permutation's and the combine's
    int64 indices (16; at ep > 1 two more: the received rows' sort and its
    inverse). The shared experts: a SwiGLU of their width.

    Forward, at the combine's weighted product, besides what is kept: the sorted
    rows (fp32 under autocast, whose 16-bit cast is what is kept; at ep > 1 the
    rows sent, the received ones being kept), the experts' output (16-bit), the
    combine's zeroed [tokens x k, hidden] slots and the fp32 product before its
    cast.

    Backward, the larger of two moments: the combine's (its fp32 gradient of
    the rows, the weighted product's two gradients: 12 bytes per row element),
    and the end of the experts' (the three stacked weights' gradients of this
    rank, fp32 where the weights are: DDP, and FSDP at ep > 1, with the 16-bit
    gradient of the cast; FSDP's 16-bit unsharded ones at ep = 1; the rows'
    gradients; the expert-wide and combine tensors already freed).

    Recomputed, at the combine's weighted product: the residual after attention
    and the MLP norm's output (the residual's dtype), the router's outputs, the
    sorted rows (where the transient buffers do not count them), the fp32 copy
    of the experts' output the product reads (none in fp32), the rows' weights
    and indices. (Backward recomputes the block and then holds what a block not
    recomputed keeps: its backward marks are the same.)"""
    m, d, ep = s.cfg.model, s.d, s.ep
    moe, h, c = m.moe, m.hidden_size, d.compute
    arch = arch_of(m)
    k, e = moe.top_k, moe.num_experts
    f = expert_width(moe, m.ffn_hidden_size)
    shared = moe.shared_experts * f
    router = 4 * e + 8 * k + (4 * k + 8 if moe.router.normalize_top_k else 0)
    router += 4 if moe.router.score == "sigmoid" else 0
    per_row = 2 * c * h + 4 * c * f + 4 * h + 4 + 16 + (16 if ep > 1 else 0)
    consumers = 1 + (2 if shared else 0)
    saved = arch.norm_saved_bytes(m, d, consumers) + router + k * per_row
    saved += arch.mlp_tensors * c * shared
    rows = k * tokens
    # The rows as permuted (the MoE input's dtype: fp32 under autocast) are kept
    # only where they are the grouped GEMM's input itself (no cast, ep = 1).
    sent = (4 if d.autocast else c) if (d.autocast or ep > 1) else 0
    transient = rows * h * (sent + (c if c < 4 else 0) + c + 4)
    fp32_weights = not s.fsdp or ep > 1
    w = e / ep * f * h  # one stacked expert weight of this rank
    cast_grad = 2 * w if fp32_weights and c < 4 else 0.0  # the 16-bit copy's gradient
    weight_grads = 3 * w * (4 if fp32_weights else d.grad) + cast_grad
    late = weight_grads + rows * (c * h - 4 * c * f)
    routed_work = max(12 * rows * h, late)
    shared_work = 0.0
    if shared:
        weight = d.grad * h * shared - (c * h * shared if d.autocast else 0)
        shared_work = arch.mlp_inputs * c * shared * tokens + weight
    rows_live = (0 if sent else d.residual * h) + (4 * h if c < 4 else 0) + 4 + 16
    recomputed = (2 * d.residual * h + router) * tokens + rows * rows_live
    return saved * tokens, max(routed_work, shared_work), transient, recomputed


def _moe_forward_mark(s: _Step) -> dict[str, _Parts]:
    """The last MoE layer's forward, in its combine: every block's saved tensors
    up to it (a recomputed block's: its input) and its transient dispatch buffers
    (`_moe_layer_bytes`; recomputed, also the tensors its forward still holds);
    autocast's weight copies so far; FSDP's gathered root and blocks (ZeRO-3:
    this block's) and one all-gather buffer."""
    m = s.cfg.model
    layers = [i for i in range(len(s.stored)) if is_moe_layer(m.moe, i)]
    if not layers:
        return {}
    i = layers[-1]
    params = s.gathered_root + (sum(s.gathered[: i + 1]) if s.zero2 else s.gathered[i])
    # FSDP: one block's all-gather buffer in flight (the next block's, prefetched;
    # the last block's own, not yet released, when it is the last)
    prefetch = s.gathered[min(i + 1, len(s.gathered) - 1)] if s.fsdp else 0.0
    acts = sum(s.stored[: i + 1]) + s.model_saved - s.final_norm + s.moe_transient
    if s.recomputed[i]:
        acts += s.moe_recomputed
    return {
        f"block {i} forward": s.start.plus(
            activations=acts + sum(s.copies[: i + 1]) + s.copy_root,
            parameters=params,
            communication=prefetch,
        )
    }


def _chunk_working_bytes(chunk: int, vocab: int, logit_bytes: int) -> int:
    """The chunked loss's working set (trainlab.models.loss, which imports torch):
    one chunk's fp32 copy of the logits (none when they are fp32) and its
    exponentials."""
    return ((4 if logit_bytes < 4 else 0) + 4) * chunk * vocab


def _forward_marks(s: _Step) -> dict[str, _Parts]:
    """End of forward, the loss's backward and the output projection's backward."""
    d, zero2 = s.d, s.zero2
    acts_all = sum(s.stored) + s.model_saved
    marks: dict[str, _Parts] = {}
    # End of forward: the loss's forward holds the logits (compute dtype), their fp32
    # copy and the log-softmax; autocast's cache holds every weight copy; FSDP holds
    # the root group (and, ZeRO-2, every block).
    fwd_logits = (d.compute + 4 + 4) * s.logits if d.compute < 4 else 8 * s.logits
    bwd_logits = 12 * s.logits
    if s.loss_chunk:  # chunked: the logits (their own gradient later) and one chunk
        fwd_logits = bwd_logits = d.compute * s.logits + s.loss_chunk
    marks["forward"] = s.start.plus(
        activations=acts_all + sum(s.copies) + s.copy_root,
        logits_loss=fwd_logits,
        parameters=s.gathered_root + (sum(s.gathered) if zero2 else 0.0),
    )
    # The loss's backward: log-softmax kept, the gradients of the loss and of the
    # log-softmax, all fp32. FSDP ZeRO-3: the root was resharded after forward.
    marks["loss backward"] = s.start.plus(
        activations=acts_all + sum(s.kept_copies) + s.copy_root,
        logits_loss=bwd_logits,
        parameters=(s.gathered_root + sum(s.gathered)) if zero2 else 0.0,
    )
    # The output projection's backward: the logits' gradient in the compute dtype,
    # the weight's gradient (16-bit then fp32 under autocast; FSDP: unsharded, kept
    # until the root's reduce-scatter at the end). FSDP gathers the root again and
    # prefetches the last block.
    out_grad = (2 + 4) * s.out_rows if d.autocast else d.grad * s.out_rows
    prefetch_last = s.gathered[-1] if (s.fsdp and not zero2 and s.gathered) else 0.0
    marks["output backward"] = s.start.plus(
        activations=acts_all + sum(s.kept_copies) + s.copy_root,
        logits_loss=d.compute * s.logits,
        gradients=out_grad,
        parameters=s.gathered_root + (sum(s.gathered) if zero2 else 0.0),
        communication=prefetch_last,
    )
    return marks


def _backward_marks(s: _Step) -> dict[str, _Parts]:
    """Each block's backward (and FSDP's reduce-scatter of it), the embedding's
    backward, FSDP's root reduce-scatter."""
    d, fsdp, zero2, m = s.d, s.fsdp, s.zero2, s.cfg.model
    V, h = m.vocab_size, m.hidden_size
    marks: dict[str, _Parts] = {}
    # Gradients of the root's parameters once the output projection is done: the
    # output's (the embedding's when tied) and the final norm's.
    tables = ("tok_embeddings.weight", "pos_embeddings.weight")
    after_out = [p for p in s.root if p.name not in tables]
    if m.tie_embeddings:
        after_out += [p for p in s.root if p.name == "tok_embeddings.weight"]
    root_grads = d.grad * s.padded(after_out) if fsdp else 4 * s.local(after_out)
    if s.carried and not fsdp:
        # Accumulated in place into the carried .grad; only the tied output's waits.
        root_grads = 4 * V * h / s.mp if m.tie_embeddings else 0.0
    done_grads = 0.0  # the blocks' gradients made so far
    below = sum(s.stored)
    rs_prev = 0.0  # FSDP: the previous group's reduce-scatter input, kept until the next
    gathered, kept = s.gathered, s.kept_copies
    for i in reversed(range(len(s.stored))):
        below -= s.stored[i]
        block_params = 0.0
        comm = rs_prev
        if fsdp:
            held = sum(gathered[: i + 1]) if zero2 else gathered[i]
            block_params = s.gathered_root + held
            if not zero2 and i > 0:
                comm += gathered[i - 1]  # the next block's all-gather, prefetched
        # Recomputed or not, the block's saved tensors exist in its backward.
        acts = below + s.model_saved - s.final_norm + s.saved[i] + s.work[i]
        marks[f"block {i} backward"] = s.start.plus(
            activations=acts + sum(kept[:i]) + s.copies[i],
            gradients=done_grads + root_grads,
            parameters=block_params,
            communication=comm,
        )
        if fsdp:
            # Its post-backward: parameters resharded, the unsharded gradients copied
            # into an fp32 reduce-scatter input (the previous one released first).
            rs = 4 * s.layer_padded[i]
            marks[f"block {i} reduce-scatter"] = s.start.plus(
                activations=below + s.model_saved - s.final_norm + sum(kept[:i]),
                gradients=done_grads + root_grads + d.grad * s.layer_padded[i] + 4 * s.layer_own[i],
                parameters=s.gathered_root + (sum(gathered[:i]) if zero2 else 0.0),
                communication=rs + (gathered[i - 1] if (i > 0 and not zero2) else 0.0),
            )
            rs_prev = rs
        if not s.carried:  # else accumulated in place into the carried gradients
            done_grads += 4 * s.layer_local[i]
    # End of backward: the embeddings' gradients. Tied, the output's gradient waited
    # in autograd's input buffer and the two are summed out of place: three [V, h]
    # at once.
    tables_numel = s.numel([p for p in s.root if p.name in tables])
    emb_grad = (d.grad if fsdp else 4) * tables_numel
    tied_sum = (d.grad if fsdp else 4) * V * h / s.mp if m.tie_embeddings else 0.0
    marks["embedding backward"] = s.start.plus(
        activations=s.model_saved - s.final_norm - s.mask - s.rope,
        gradients=done_grads + root_grads + emb_grad + tied_sum,
        parameters=s.gathered_root,
        communication=rs_prev,
    )
    if fsdp:
        # The root's post-backward: resharded, its gradients into an fp32
        # reduce-scatter input (the last block's released first).
        marks["end of backward"] = s.start.plus(
            gradients=done_grads + d.grad * s.numel(s.root),
            communication=4 * s.padded(s.root),
        )
    return marks


def _optimizer_mark(s: _Step) -> _Parts:
    """The optimizer step: all gradients, and the optimizer's temporaries (AdamW:
    sqrt(exp_avg_sq); Muon: one matrix's gathered update and Newton-Schulz)."""
    return s.persistent.plus(gradients=s.all_grads, optimizer=s.opt_temp)


def estimate_memory(
    cfg: ExperimentConfig, layout: Any, micro_batch: int, ep: int | None = None
) -> MemoryEstimate:
    """`memory_breakdown` with the high-water marks it is the largest of: the
    step's terms (`_step`: model state by category, activations by block), then
    each phase's marks."""
    s = _step(cfg, layout, micro_batch, ep)
    marks = {
        **_moe_forward_mark(s),
        **_forward_marks(s),
        **_backward_marks(s),
        "optimizer": _optimizer_mark(s),
    }
    breakdowns = {name: mark.as_dict() for name, mark in marks.items()}
    phase = max(breakdowns, key=lambda name: breakdowns[name]["total"])
    phases = {name: b["total"] for name, b in breakdowns.items()}
    return MemoryEstimate(breakdowns[phase], phase, phases, s.notes, breakdowns)


def experts_state_bytes(
    cfg: ExperimentConfig, layout: Any, ep: int | None = None
) -> dict[str, float]:
    """The routed experts' share of the model state per device, as `_step` counts
    it (so as the trainer holds it): their parameters and gradients (fp32, 4 bytes
    per element rank 0 holds: num_experts/ep of them at ep > 1, FSDP's shard at
    ep = 1, else all), the optimizer's state of them (trainlab.optim's own
    figures) and DDP's gradient buckets (at ep = 1 only: at ep > 1 DDP ignores
    them). Zeros for a dense model."""
    t, dp, zero = cfg.train, layout.dp, layout.zero_stage
    fsdp, zero1 = zero >= 2 and dp > 1, zero == 1 and dp > 1
    ddp = layout.tp * layout.pp * dp > 1 and not fsdp
    ep = expert_parallel(cfg, layout, ep)
    mp = layout.pp  # the routed experts: replicated over tp (trainlab.train.parallel.tensor)
    experts = [p for p in _param_shapes(cfg) if is_routed_expert(p)]
    local = sum(_local(p, dp, fsdp, ep) for p in experts) / mp
    mine = {p.name for p in experts}
    if zero1:
        whole = [PlanParam(p.name, p.shape, p.layer, p.numel) for p in _param_shapes(cfg)]
        mine &= {p.name for p in _zero1_share(t.optimizer.plan_groups(whole), dp)}
    stepped = [
        PlanParam(p.name, p.shape, p.layer, _local(p, dp, fsdp, ep) / mp)
        for p in experts
        if p.name in mine
    ]
    return {
        "parameters": 4 * local,
        "gradients": 4 * local,
        "optimizer": t.optimizer.memory(stepped, cfg.resource.use_gpu).state if stepped else 0.0,
        "communication": 4 * _experts_numel(cfg) / mp if (ddp and ep == 1) else 0.0,
    }
