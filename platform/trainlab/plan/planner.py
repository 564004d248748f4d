"""The planner: from a validated config to a parallel layout that fits and runs.

It decides *where and how many*: tp/pp/dp and the ZeRO stage, the recomputation
mode and micro batch, the memory each device needs (`trainlab.plan.memory`: what
the trainer allocates), how many nodes, and FLOPs per token for MFU. `plan()` never raises for a layout that does not fit; it
returns `fits=False` with notes saying why and what to change, and
`require_fit()` turns that into a user error.

The levers, in the order people reach for them (each only where the config left
it open; an explicit value is respected):

1. ZeRO sharding of data parallelism, stage 0 -> 3 (least communication first);
2. a smaller micro batch (`data.micro_batch_size: auto`), more gradient
   accumulation in its place: costs a little kernel efficiency, no compute;
3. recomputation (`parallel.activation_checkpointing: auto`): none -> selective
   -> full, which costs up to one more forward per step;
4. tensor parallelism (within a node), then pipeline parallelism (across
   nodes), composed with FSDP over what is left of the devices.

An MoE (`model.moe`) is searched without pp (refused with it); at tp > 1 its MoE
layers are replicated over tp and the rest is split. Under `strategy: auto` each
layout is sized with the parallel.ep `choose_ep` gives it there (each device then
holds num_experts/ep of the routed experts), so expert parallelism can make an MoE
fit at a layout that would not hold every expert on every device.

The global batch is the experiment's (`data.global_batch_size`): every layout
keeps it by choosing grad_accum_steps = global / (micro_batch x dp). Without it,
the global batch is micro_batch x grad_accum_steps x dp and follows dp.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from trainlab.config.dims import ParallelDims, layout_executes
from trainlab.config.schema import ExperimentConfig
from trainlab.errors import UserError
from trainlab.models.registry import arch_of
from trainlab.plan.model_math import (
    GiB,
    count_params,
    flops_per_token,
)

# Fraction of device memory the plan may fill; the rest absorbs allocator
# fragmentation, the CUDA context, communication buffers and temporaries.
SAFETY_MARGIN = 0.10
MAX_MICRO_BATCH = 65536
# Recomputation modes from the cheapest in compute to the cheapest in memory.
RECOMPUTE_LADDER = ("none", "selective", "full")
# `more devices` suggestions try the world size doubled up to this many times.
MAX_DOUBLINGS = 12


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    zero_stage: int
    # An MoE's parallel.ep (a plan's `parallel` has it: Layout(**plan.parallel));
    # None: the memory model takes the planner's choice or the config's.
    ep: int | None = None

    @property
    def strategy(self) -> str:
        return "ddp" if self.zero_stage <= 1 else "fsdp"

    @property
    def executes(self) -> bool:
        """Whether the trainer runs it (decided in trainlab.config.dims)."""
        return layout_executes(self.tp, self.pp, self.dp, self.zero_stage) is None

    def describe(self) -> str:
        return (
            f"tp={self.tp} pp={self.pp} dp={self.dp} zero_stage={self.zero_stage} ({self.strategy})"
        )


@dataclass(frozen=True)
class Setting:
    """One point of the search: a layout with its recomputation mode and batch split."""

    layout: Layout
    recompute: str
    micro_batch: int
    grad_accum: int
    memory: dict[str, float]

    @property
    def total(self) -> float:
        return self.memory["total"]


@dataclass
class Plan:
    num_params: int
    params_breakdown: dict[str, int]
    world_size: int
    strategy: str
    parallel: dict[str, int]
    memory_per_device_bytes: dict[str, float]
    device_memory_bytes: float
    usable_memory_bytes: float
    flops_per_token: float
    micro_batch_size: int
    micro_batch_size_max: int
    global_batch_size: int
    tokens_per_step: int
    fits: bool
    notes: list[str] = field(default_factory=list)
    nodes: int = 1
    grad_accum_steps: int = 1
    activation_checkpointing: str = "none"
    # The layout (tp/pp/dp/zero_stage) that would fit if tensor/pipeline parallelism
    # ran, when no executable one does; None otherwise.
    would_fit_with_tp_pp: dict[str, int] | None = None
    # train.optimizer.name, and what one checkpoint takes per parameter with it.
    optimizer: str = "adamw"
    checkpoint_bytes_per_param: float = 12.0
    # An elastic run: {"min": ..., "max": ...}, the layout and memory at each end.
    elastic: dict[str, dict[str, Any]] | None = None
    # An MoE's parameters one token goes through (None: dense, all of them).
    num_params_active: int | None = None
    # An MoE's routed experts: their parameters and their share of the memory per
    # device (moe_share); None for a dense model.
    moe: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        mem = {k: int(round(v)) for k, v in self.memory_per_device_bytes.items()}
        return {
            "num_params": self.num_params,
            "params_breakdown": self.params_breakdown,
            **({"num_params_active": self.num_params_active} if self.num_params_active else {}),
            "world_size": self.world_size,
            "nodes": self.nodes,
            "strategy": self.strategy,
            "parallel": self.parallel,
            "activation_checkpointing": self.activation_checkpointing,
            "memory_per_device_bytes": mem,
            "device_memory_bytes": int(self.device_memory_bytes),
            "usable_memory_bytes": int(self.usable_memory_bytes),
            "flops_per_token": int(round(self.flops_per_token)),
            "micro_batch_size": self.micro_batch_size,
            "micro_batch_size_max": self.micro_batch_size_max,
            "grad_accum_steps": self.grad_accum_steps,
            "global_batch_size": self.global_batch_size,
            "tokens_per_step": self.tokens_per_step,
            "fits": self.fits,
            "would_fit_with_tp_pp": self.would_fit_with_tp_pp,
            "optimizer": self.optimizer,
            "checkpoint_bytes_per_param": round(self.checkpoint_bytes_per_param, 4),
            "notes": self.notes,
            **({"elastic": self.elastic} if self.elastic is not None else {}),
            **({"moe": self.moe} if self.moe is not None else {}),
        }


def _checkpoint_bytes_per_param(cfg: ExperimentConfig) -> float:
    from trainlab.plan.memory import checkpoint_bytes_per_param

    return checkpoint_bytes_per_param(cfg)


def host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16.0 * GiB


def device_memory_bytes(cfg: ExperimentConfig) -> tuple[float, str]:
    r = cfg.resource
    if r.use_gpu:
        return r.gpu_memory_gb * GiB, f"GPU memory {r.gpu_memory_gb:g} GiB (resource.gpu_memory_gb)"
    if r.cpu_memory_gb is not None:
        return r.cpu_memory_gb * GiB, f"CPU memory {r.cpu_memory_gb:g} GiB per worker"
    total = host_memory_bytes()
    return total / r.world_size, (
        f"CPU workers share this host's {total / GiB:.1f} GiB: "
        f"{total / r.world_size / GiB:.1f} GiB each (set resource.cpu_memory_gb to override)"
    )


def nodes_needed(cfg: ExperimentConfig) -> int:
    """Nodes the run spans: GPU workers fill nodes of resource.gpus_per_node; CPU
    runs are planned on one node."""
    r = cfg.resource
    return math.ceil(r.world_size / r.gpus_per_node) if r.use_gpu else 1


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def candidate_layouts(cfg: ExperimentConfig) -> list[Layout]:
    """Every legal layout, best first: least communication.

    Order: pipeline stages (across nodes, bubbles) cost most, then tensor
    parallelism (per-layer all-reduces, within a node), then ZeRO sharding of
    data parallelism (one reduce-scatter/all-gather per step). So sort by
    (pp, tp, zero_stage). Values the user set in `parallel` are constraints.
    Includes the few layouts the trainer does not execute (`Layout.executes`).
    """
    m, p, r = cfg.model, cfg.parallel, cfg.resource
    world = r.world_size
    per_node = r.gpus_per_node if r.use_gpu else world
    kv = m.num_kv_heads or m.num_heads
    arch = arch_of(m)
    measured = arch.measured  # pp, and tp without a plan, are refused (config rules)
    no_tp = measured and arch.tensor_parallel_refusal(m) is not None
    # An MoE is searched without pp (the config rules refuse pp with model.moe);
    # at tp > 1 its MoE layers are replicated over tp, the rest is split.
    moe = m.moe is not None
    out = []
    for tp in _divisors(world):
        if no_tp and tp > 1:
            continue
        if tp > per_node or m.num_heads % tp or kv % tp or (p.tp and tp != p.tp):
            continue
        if m.vocab_size % tp or (m.ffn_hidden_size or 0) % tp:
            continue
        for pp in _divisors(world // tp):
            if m.num_layers % pp or (p.pp and pp != p.pp) or ((measured or moe) and pp > 1):
                continue
            dp = world // (tp * pp)
            if p.dp and dp != p.dp:
                continue
            # Sharding over a single replica does nothing: with dp == 1 only stage 0.
            stages = [0] if dp == 1 else [0, 1, 2, 3]
            if p.zero_stage is not None:
                stages = [p.zero_stage] if (dp > 1 or p.zero_stage == 0) else [0]
            out.extend(Layout(tp, pp, dp, z) for z in stages)
    out.sort(key=lambda lay: (lay.pp, lay.tp, lay.zero_stage))
    return out


def _groups(layouts: list[Layout]) -> list[list[Layout]]:
    """Layouts grouped by (tp, pp, dp), in order; ZeRO stages ascending within a group."""
    groups: dict[tuple[int, int, int], list[Layout]] = {}
    for lay in layouts:
        groups.setdefault((lay.tp, lay.pp, lay.dp), []).append(lay)
    return list(groups.values())


def _variant(cfg: ExperimentConfig, **sections: dict[str, Any]) -> ExperimentConfig:
    """A copy of `cfg` with fields of some sections replaced (not re-validated: the
    planner's own what-ifs)."""
    update = {name: getattr(cfg, name).model_copy(update=vals) for name, vals in sections.items()}
    return cfg.model_copy(update=update)


def _memory(cfg: ExperimentConfig, lay: Layout, micro_batch: int) -> dict[str, float]:
    """Bytes per device by category (and `total`) for `cfg` as configured at `lay`,
    with the parallel.ep the plan gives it there (`choose_ep`: an MoE's routed
    experts split over ep ranks): the trainer's memory model
    (`trainlab.plan.memory.memory_breakdown`).
    `cfg.parallel.activation_checkpointing` must be a concrete mode (not auto)."""
    from trainlab.plan.memory import memory_breakdown  # memory.py imports this module

    ep = choose_ep(cfg, lay)[0] if cfg.model.moe is not None else 1
    return memory_breakdown(cfg, lay, micro_batch, ep)


def _batch_splits(cfg: ExperimentConfig, dp: int, pp: int = 1) -> tuple[list[tuple[int, int]], str]:
    """(micro batch, grad_accum_steps) pairs for `dp` replicas (of `pp` pipeline
    stages: each pair must give the pipeline at least pp micro batches), largest
    micro batch first, and why there are none when the list is empty."""
    splits, why = _dp_batch_splits(cfg, dp)
    if pp == 1 or not splits:
        return splits, why
    from trainlab.config.rules import pipeline_microbatches

    given = cfg.parallel.pp_microbatches
    piped = [(m, a) for m, a in splits if pipeline_microbatches(m * a, m, pp, given) is not None]
    if not piped:
        rows = splits[0][0] * splits[0][1]
        return [], (
            f"{rows} sequences per data-parallel rank cannot fill a pipeline of pp={pp} "
            "stages (set data.global_batch_size)"
        )
    return piped, ""


def _dp_batch_splits(cfg: ExperimentConfig, dp: int) -> tuple[list[tuple[int, int]], str]:
    """(micro batch, grad_accum_steps) pairs for `dp` ranks, largest micro batch
    first, and why there are none when the list is empty.

    With data.global_batch_size every pair multiplies to it (times dp); without it
    the pair is the config's own and the global batch follows dp."""
    d = cfg.data
    g = d.global_batch_size
    if g is None:
        return [(int(d.micro_batch_size), d.grad_accum_steps or 1)], ""
    if g % dp:
        return [], f"data.global_batch_size {g} is not a multiple of dp={dp}"
    per_rank = g // dp
    if d.micro_batch_size == "auto":
        mbs = [m for m in reversed(_divisors(per_rank)) if m <= MAX_MICRO_BATCH]
    elif per_rank % d.micro_batch_size == 0:
        mbs = [d.micro_batch_size]
    else:
        return [], (
            f"data.global_batch_size {g} over dp={dp} is {per_rank} sequences per rank, "
            f"not a multiple of data.micro_batch_size {d.micro_batch_size}"
        )
    if d.grad_accum_steps is not None:
        mbs = [m for m in mbs if per_rank // m == d.grad_accum_steps]
        if not mbs:
            return [], (
                f"data.global_batch_size {g} over dp={dp} with data.grad_accum_steps "
                f"{d.grad_accum_steps} leaves no whole micro batch"
            )
    return [(m, per_rank // m) for m in mbs], ""


class _Search:
    """The lever search over one config: memory per setting, cached."""

    def __init__(self, cfg: ExperimentConfig, usable: float):
        self.cfg, self.usable = cfg, usable
        mode = cfg.parallel.activation_checkpointing
        self.modes = RECOMPUTE_LADDER if mode == "auto" else (mode,)
        self._cfgs: dict[tuple[str, int], ExperimentConfig] = {}
        self._cache: dict[tuple[Layout, int, str, int], dict[str, float]] = {}

    def _cfg(self, mode: str, grad_accum: int) -> ExperimentConfig:
        """`cfg` as it would run: this recomputation mode and gradient accumulation
        (the memory model reads both from the config)."""
        key = (mode, grad_accum)
        if key not in self._cfgs:
            p, d = self.cfg.parallel, self.cfg.data
            sections: dict[str, dict[str, Any]] = {}
            if p.activation_checkpointing != mode:
                sections["parallel"] = {"activation_checkpointing": mode}
            if d.grad_accum_steps != grad_accum:
                sections["data"] = {"grad_accum_steps": grad_accum}
            self._cfgs[key] = _variant(self.cfg, **sections) if sections else self.cfg
        return self._cfgs[key]

    def memory(self, lay: Layout, micro_batch: int, mode: str, grad_accum: int) -> dict[str, float]:
        key = (lay, micro_batch, mode, grad_accum)
        if key not in self._cache:
            self._cache[key] = _memory(self._cfg(mode, grad_accum), lay, micro_batch)
        return self._cache[key]

    def iter_settings(self, group: list[Layout]) -> Iterator[Setting]:
        """Every setting of a (tp, pp, dp) group in lever order: recomputation is the
        outer loop, then the micro batch (largest first), then the ZeRO stage."""
        splits, _ = _batch_splits(self.cfg, group[0].dp, group[0].pp)
        for mode in self.modes:
            for mb, ga in splits:
                for lay in group:
                    yield Setting(lay, mode, mb, ga, self.memory(lay, mb, mode, ga))

    def visited(self, group: list[Layout], chosen: Setting) -> list[Setting]:
        """The settings the search tried before it reached `chosen` (and `chosen`)."""
        out = []
        for s in self.iter_settings(group):
            out.append(s)
            if s == chosen:
                break
        return out

    def leanest(self, group: list[Layout]) -> list[Setting]:
        """The group's settings that need the least memory: the strongest recomputation
        and the most sharded stage, at every micro batch. Memory grows with the micro
        batch and with gradient accumulation (the carried gradients), and shrinks with
        recomputation and sharding, so the group's minimum is among these."""
        splits, _ = _batch_splits(self.cfg, group[0].dp, group[0].pp)
        mode, lay = self.modes[-1], group[-1]
        return [Setting(lay, mode, mb, ga, self.memory(lay, mb, mode, ga)) for mb, ga in splits]

    def can_fit(self, group: list[Layout]) -> bool:
        """Whether any setting of the group fits, from its leanest corners: the strongest
        recomputation at the most sharded stage, with the largest micro batch (least
        accumulation) or the smallest (least activation memory). Between them memory
        only grows, so a group whose corners do not fit has no setting that does; this
        spares walking every lever (the memory model is not free)."""
        splits, _ = _batch_splits(self.cfg, group[0].dp, group[0].pp)
        if not splits:
            return False
        mode, lay = self.modes[-1], group[-1]
        return any(
            self.memory(lay, mb, mode, ga)["total"] <= self.usable
            for mb, ga in dict.fromkeys((splits[0], splits[-1]))
        )

    def first_fit(self, groups: list[list[Layout]]) -> Setting | None:
        for group in groups:
            if self.can_fit(group):
                for s in self.iter_settings(group):
                    if s.total <= self.usable:
                        return s
        return None

    def smallest(self, groups: list[list[Layout]]) -> Setting | None:
        every = [s for group in groups for s in self.leanest(group)]
        return min(every, key=lambda s: s.total) if every else None

    def max_micro_batch(self, lay: Layout, mode: str, grad_accum: int) -> int:
        """Largest micro batch whose total fits at `lay` (memory grows with it)."""

        def fits(mb: int) -> bool:
            return self.memory(lay, mb, mode, grad_accum)["total"] <= self.usable

        if not fits(1):
            return 0
        lo = 1  # gallop up, then bisect: few calls of the memory model
        while lo < MAX_MICRO_BATCH:
            hi = min(2 * lo, MAX_MICRO_BATCH)
            if not fits(hi):
                return _bisect(fits, lo, hi)
            lo = hi
        return MAX_MICRO_BATCH


def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest n in [lo, hi) with fits(n), given fits(lo) and not fits(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _executable_groups(cfg: ExperimentConfig) -> list[list[Layout]]:
    """The layouts the trainer runs, as the planner would consider them."""
    p = cfg.parallel
    if p.strategy != "auto":
        dims = ParallelDims.of(cfg)
        return [[Layout(dims.tp, dims.pp, dims.dp, dims.zero_stage)]]
    return _groups([lay for lay in candidate_layouts(cfg) if lay.executes])


def _runs_and_fits(cfg: ExperimentConfig) -> bool:
    """Whether an executable setting of `cfg` fits (a what-if of the planner's own)."""
    dev, _ = device_memory_bytes(cfg)
    search = _Search(cfg, dev * (1 - SAFETY_MARGIN))
    return any(search.can_fit(group) for group in _executable_groups(cfg))


def _what_to_change(cfg: ExperimentConfig) -> list[str]:
    """Changes that make an executable layout fit: each tried on its own."""
    d, p, r = cfg.data, cfg.parallel, cfg.resource
    fixes = []
    world = r.world_size
    # With a stated global batch, grad_accum_steps follows the other sizes.
    accum = {"grad_accum_steps": None} if d.global_batch_size is not None else {}
    for k in range(1, MAX_DOUBLINGS + 1):
        n = world * 2**k
        if n > 100_000:
            break
        more = _variant(
            cfg,
            resource={"num_workers": n},
            parallel={"dp": None if p.strategy == "auto" else n},
            data=accum,
        )
        if _runs_and_fits(more):
            where = f" ({nodes_needed(more)} nodes)" if r.use_gpu else ""
            fixes.append(f"resource.num_workers: {n}{where}")
            break
    stage = p.zero_stage or 0
    if p.strategy == "auto" and p.zero_stage is not None:
        if _runs_and_fits(_variant(cfg, parallel={"zero_stage": None})):
            fixes.append("parallel.zero_stage: null (the planner picks the stage)")
    elif p.strategy != "auto":
        for strategy, z in (("ddp", 1), ("fsdp", 2), ("fsdp", 3)):
            if z > stage and _runs_and_fits(
                _variant(cfg, parallel={"strategy": strategy, "zero_stage": z})
            ):
                fixes.append(f"parallel.strategy: {strategy} with parallel.zero_stage: {z}")
                break
    fixes += _ep_fixes(cfg)
    mb = d.micro_batch_size
    if mb != "auto" and mb > 1:
        smaller = {mb >> k for k in range(1, mb.bit_length())}
        if d.global_batch_size is not None:
            dp = ParallelDims.of(cfg).dp
            smaller |= {x for x in _divisors(d.global_batch_size // dp) if x < mb}
        for x in sorted(smaller, reverse=True):
            if _runs_and_fits(_variant(cfg, data={"micro_batch_size": x, **accum})):
                fixes.append(f"data.micro_batch_size: {x}")
                break
    mode = p.activation_checkpointing
    if mode != "auto" and mode != RECOMPUTE_LADDER[-1]:
        for stronger in RECOMPUTE_LADDER[RECOMPUTE_LADDER.index(mode) + 1 :]:
            if _runs_and_fits(_variant(cfg, parallel={"activation_checkpointing": stronger})):
                fixes.append(f"parallel.activation_checkpointing: {stronger}")
                break
    if not fixes:
        return [
            "no layout fits with more devices, ZeRO sharding, a smaller micro batch or "
            "more recomputation: the model needs devices with more memory"
        ]
    return ["to fit now, change one of: " + "; ".join(fixes)]


def _ep_fixes(cfg: ExperimentConfig) -> list[str]:
    """An MoE's expert parallelism as a lever (each device keeps num_experts/ep of
    the routed experts): under `strategy: auto` with parallel.ep pinned, leaving it
    to the planner (`choose_ep`); with a concrete strategy, the smallest larger ep
    the trainer runs (dividing dp and num_experts; not with ZeRO-1) that fits."""
    m, p = cfg.model, cfg.parallel
    if m.moe is None:
        return []
    if p.strategy == "auto":
        if p.ep is not None and _runs_and_fits(_variant(cfg, parallel={"ep": None})):
            return ["parallel.ep: null (the planner picks it)"]
        return []
    dims = ParallelDims.of(cfg)
    if dims.pp > 1 or dims.zero_stage == 1:
        return []
    for ep in _divisors(math.gcd(dims.dp, m.moe.num_experts)):
        if ep > (p.ep or 1) and _runs_and_fits(_variant(cfg, parallel={"ep": ep})):
            return [f"parallel.ep: {ep}"]
    return []


def _gib(b: float) -> str:
    return f"{b / GiB:.1f} GiB"


def _lever_notes(search: _Search, group: list[Layout], chosen: Setting) -> list[str]:
    """Which lever the search moved, and what the cheaper settings would have needed."""
    usable = _gib(search.usable)
    settings = search.visited(group, chosen)
    notes = []
    lay = chosen.layout
    lower = [
        s
        for s in settings
        if s.recompute == chosen.recompute
        and s.micro_batch == chosen.micro_batch
        and s.layout.zero_stage < lay.zero_stage
    ]
    if lower:
        worst = lower[-1]
        notes.append(
            f"layout {lay.describe()}: zero_stage {worst.layout.zero_stage} needs "
            f"{_gib(worst.total)} > {usable} usable (ZeRO stages are tried 0 -> 3)"
        )
    else:
        notes.append(f"layout {lay.describe()}: the least-communicating layout that fits")
    if search.cfg.data.micro_batch_size == "auto":
        bigger = [
            s
            for s in settings
            if s.recompute == chosen.recompute and s.micro_batch > chosen.micro_batch
        ]
        if bigger:
            nearest = min(bigger, key=lambda s: (s.micro_batch, s.total))
            best = min(
                (s for s in bigger if s.micro_batch == nearest.micro_batch),
                key=lambda s: s.total,
            )
            notes.append(
                f"micro_batch_size: {chosen.micro_batch} (auto; {best.micro_batch} did not "
                f"fit: {_gib(best.total)} > {usable})"
            )
        else:
            notes.append(
                f"micro_batch_size: {chosen.micro_batch} (auto; the whole per-rank batch fits)"
            )
    if len(search.modes) > 1:
        i = search.modes.index(chosen.recompute)
        if i == 0:
            notes.append(f"activation_checkpointing: {chosen.recompute} (auto; it fits)")
        else:
            prev = search.modes[i - 1]
            best = min((s for s in settings if s.recompute == prev), key=lambda s: s.total)
            notes.append(
                f"activation_checkpointing: {chosen.recompute} (auto; {prev} did not fit: "
                f"{_gib(best.total)} > {usable})"
            )
    return notes


def _fallback(cfg: ExperimentConfig, search: _Search, lay: Layout) -> Setting:
    """What to show when no split of the global batch exists for `lay`."""
    d = cfg.data
    mb = 1 if d.micro_batch_size == "auto" else d.micro_batch_size
    g = d.global_batch_size
    ga = d.grad_accum_steps or (max(1, g // (mb * lay.dp)) if g else 1)
    mode = search.modes[-1]
    return Setting(lay, mode, mb, ga, search.memory(lay, mb, mode, ga))


def plan(cfg: ExperimentConfig) -> Plan:
    """Plan the run. With `parallel.strategy: auto` pick the layout; otherwise check it.
    Either way pick the recomputation mode and micro batch where the config says auto.
    An elastic run (`resource.num_workers: {min, max}`) is planned at both ends
    (`plan_elastic`)."""
    if cfg.resource.elastic:
        return plan_elastic(cfg)
    return _plan_fixed(cfg)


def _active_params(m: Any, total: int) -> int | None:
    """An MoE's active parameter count; None when every parameter is active."""
    active = arch_of(m).active_params(m)
    return active if active != total else None


# strategy auto picks parallel.ep for an MoE whose routed experts are at least this
# share of the parameters (then their state dominates each device's memory).
EP_EXPERTS_SHARE = 0.5


def choose_ep(cfg: ExperimentConfig, lay: Layout) -> tuple[int, str | None]:
    """parallel.ep at layout `lay`, and why (a plan note) when chosen: as configured;
    under `strategy: auto`, for an MoE on GPUs whose routed experts are at least
    EP_EXPERTS_SHARE of the parameters, the largest ep that divides dp and
    num_experts and stays within a node (its all-to-all on the node's links), when
    the layout runs it (no pp, not ZeRO-1); else 1. Each device then keeps
    1/ep of the experts' weights, gradients and optimizer state (under FSDP,
    which leaves them unsharded at ep > 1, that is more than ZeRO's 1/dp shards
    when ep < dp, and no all-gather or reduce-scatter of them: `_memory` sizes
    each layout with this ep, so the search sees either way)."""
    from trainlab.models.moe import moe_layer_count, moe_params

    m, p = cfg.model, cfg.parallel
    if p.ep is not None or m.moe is None:
        return p.ep or 1, None
    if p.strategy != "auto" or not cfg.resource.use_gpu:
        return 1, None
    if lay.pp > 1 or lay.zero_stage == 1:
        return 1, None
    routed = moe_params(m.moe, m.hidden_size, m.ffn_hidden_size)["routed"]
    share = routed * moe_layer_count(m.moe, m.num_layers) / count_params(m).total
    if share < EP_EXPERTS_SHARE:
        return 1, None
    # an ep group is the dp ranks of one tp coordinate: on a node, gpus_per_node/tp
    limit = min(lay.dp, m.moe.num_experts, cfg.resource.gpus_per_node // lay.tp)
    ep = max(d for d in range(1, limit + 1) if lay.dp % d == 0 and m.moe.num_experts % d == 0)
    if ep == 1:
        return 1, None
    return ep, (
        f"parallel.ep {ep}: the routed experts are {share:.0%} of the parameters; split over "
        f"{ep} data-parallel ranks of a node (dp2ep), each device keeps 1/{ep} of their state"
    )


def moe_share(
    cfg: ExperimentConfig,
    lay: Layout,
    ep: int = 1,
    micro_batch: int = 1,
    grad_accum: int = 1,
) -> dict[str, Any] | None:
    """The routed experts of an MoE (model.moe) at layout `lay` and parallel.ep:
    their parameters (all layers), the parameters of one expert, and the bytes of
    their weights, gradients, optimizer state and DDP gradient buckets per device
    as memory_per_device_bytes counts them (`trainlab.plan.memory.
    experts_state_bytes`: num_experts/ep of them per device at ep > 1, where DDP
    and FSDP leave them alone). None for a dense model."""
    from trainlab.models.moe import moe_layer_count, moe_params
    from trainlab.plan.memory import experts_state_bytes

    m = cfg.model
    if m.moe is None:
        return None
    parts = moe_params(m.moe, m.hidden_size, m.ffn_hidden_size)
    routed = parts["routed"] * moe_layer_count(m.moe, m.num_layers)
    share = routed / count_params(m).total
    layers = moe_layer_count(m.moe, m.num_layers)
    width = parts["expert"] // (3 * m.hidden_size)
    act = 4 if cfg.train.precision == "fp32" else 2
    rows = micro_batch * cfg.data.seq_len * m.moe.top_k  # (token, expert) rows of a micro batch
    rows_per_step = rows * grad_accum
    return {
        "ep": ep,
        "experts_params": routed,
        "expert_params": parts["expert"],
        "experts_share_of_params": round(share, 6),
        # rank 0's experts: 1/ep of them at ep > 1 (in memory_per_device_bytes too)
        "experts_bytes_per_device": {
            k: int(round(v)) for k, v in experts_state_bytes(cfg, lay, ep).items()
        },
        # One MoE layer's dispatch buffers per micro batch, dropless, balanced: the
        # sorted rows and their outputs (2 x hidden) and the experts' gate, up and
        # product (3 x width) per row, in the compute dtype (a summary figure; the
        # activations of memory_per_device_bytes count what the MoE layer keeps for
        # backward, these buffers among them: trainlab.plan.memory._moe_layer_bytes).
        "dispatch_bytes_per_layer": int(rows * act * (2 * m.hidden_size + 3 * width)),
        # Bytes this rank sends by all-to-all per optimizer step at parallel.ep:
        # each row's hidden state out and its output back, in forward and again
        # (their gradients) in backward, the (ep-1)/ep of rows bound for other ranks.
        "all_to_all_bytes_per_step": int(
            4 * rows_per_step * m.hidden_size * act * layers * (ep - 1) / ep
        ),
    }


def _plan_fixed(cfg: ExperimentConfig) -> Plan:
    m, r = cfg.model, cfg.resource
    pc = count_params(m)
    dev_mem, mem_note = device_memory_bytes(cfg)
    usable = dev_mem * (1 - SAFETY_MARGIN)
    notes = [mem_note, f"usable: {usable / GiB:.1f} GiB after a {SAFETY_MARGIN:.0%} safety margin"]
    search = _Search(cfg, usable)
    groups = _executable_groups(cfg)
    for group in groups:
        splits, why = _batch_splits(cfg, group[0].dp, group[0].pp)
        if not splits:
            lay = group[0]
            where = (
                f"dp={lay.dp}" if lay.tp * lay.pp == 1 else f"tp={lay.tp} pp={lay.pp} dp={lay.dp}"
            )
            notes.append(f"skipped {where}: {why}")
    chosen = search.first_fit(groups)
    fits = chosen is not None
    hypothetical: Setting | None = None
    if chosen is not None:
        group = next(g for g in groups if chosen.layout in g)
        if cfg.parallel.strategy != "auto":
            p = cfg.parallel
            notes.append(f"layout as configured: strategy {p.strategy}, {chosen.layout.describe()}")
            notes.extend(_lever_notes(search, group, chosen)[1:])
        else:
            notes.extend(_lever_notes(search, group, chosen))
    else:
        shown = search.smallest(groups)
        if shown is None:
            lay = groups[0][0] if groups else Layout(1, 1, r.world_size, 0)
            if not groups:
                notes.append("no legal layout for the given constraints")
            shown = _fallback(cfg, search, lay)
        chosen = shown
        what = "as configured" if cfg.parallel.strategy != "auto" else "the smallest footprint"
        notes.append(
            f"does not fit: {chosen.total / GiB:.2f} GiB per device > usable "
            f"{usable / GiB:.2f} GiB of {dev_mem / GiB:.2f} GiB device memory "
            f"({what}: {chosen.layout.describe()}, activation_checkpointing "
            f"{chosen.recompute}, micro batch {chosen.micro_batch})"
        )
        if cfg.parallel.strategy == "auto":
            model_parallel = [lay for lay in candidate_layouts(cfg) if not lay.executes]
            hypothetical = search.first_fit(_groups(model_parallel))
            if hypothetical is not None:
                h = hypothetical
                notes.append(
                    f"would fit as {h.layout.describe()} with activation_checkpointing "
                    f"{h.recompute} and micro batch {h.micro_batch} ({_gib(h.total)}) if "
                    "ZeRO-1 composed with tensor/pipeline parallelism, which trainlab does not run"
                )
        notes.extend(_what_to_change(cfg))

    lay = chosen.layout
    gbs = chosen.micro_batch * chosen.grad_accum * lay.dp
    if cfg.data.global_batch_size is not None:
        gbs = cfg.data.global_batch_size
        notes.append(
            f"global batch {gbs} sequences (data.global_batch_size) = micro batch "
            f"{chosen.micro_batch} x grad_accum_steps {chosen.grad_accum} x dp {lay.dp}"
        )
    else:
        notes.append(
            f"global batch {gbs} = micro_batch_size {chosen.micro_batch} x grad_accum_steps "
            f"{chosen.grad_accum} x dp {lay.dp}: it follows dp (the device count and layout); "
            "set data.global_batch_size to keep it fixed"
        )
    ep, ep_note = choose_ep(cfg, lay)
    if ep_note:
        notes.append(ep_note)
    nodes = nodes_needed(cfg)
    if nodes > 1:
        notes.append(
            f"needs {nodes} nodes for {r.world_size} workers "
            f"({r.gpus_per_node} per node, resource.gpus_per_node)"
        )
    return Plan(
        num_params=pc.total,
        num_params_active=_active_params(m, pc.total),
        moe=moe_share(cfg, lay, ep, chosen.micro_batch, chosen.grad_accum),
        params_breakdown=pc.as_dict(),
        optimizer=cfg.train.optimizer.name,
        checkpoint_bytes_per_param=_checkpoint_bytes_per_param(cfg),
        world_size=r.world_size,
        strategy=lay.strategy,
        parallel={
            "tp": lay.tp,
            "pp": lay.pp,
            "dp": lay.dp,
            "zero_stage": lay.zero_stage,
            **({"ep": ep} if m.moe is not None else {}),
        },
        memory_per_device_bytes=chosen.memory,
        device_memory_bytes=dev_mem,
        usable_memory_bytes=usable,
        flops_per_token=flops_per_token(m, cfg.data.seq_len),
        micro_batch_size=chosen.micro_batch,
        micro_batch_size_max=search.max_micro_batch(lay, chosen.recompute, chosen.grad_accum),
        global_batch_size=gbs,
        tokens_per_step=gbs * cfg.data.seq_len,
        fits=fits,
        notes=notes,
        nodes=nodes,
        grad_accum_steps=chosen.grad_accum,
        activation_checkpointing=chosen.recompute,
        would_fit_with_tp_pp=(
            None
            if hypothetical is None
            else {
                "tp": hypothetical.layout.tp,
                "pp": hypothetical.layout.pp,
                "dp": hypothetical.layout.dp,
                "zero_stage": hypothetical.layout.zero_stage,
            }
        ),
    )


def require_fit(p: Plan) -> None:
    """Raise a one-line user error when the plan does not fit its devices."""
    if not p.fits:
        reason = next((n for n in p.notes if n.startswith("does not fit")), "plan does not fit")
        raise UserError(f"plan: {reason}")


def resolve_layout(cfg: ExperimentConfig, p: Plan | None = None) -> ExperimentConfig:
    """A copy of `cfg` made concrete from the plan: `parallel` (strategy never auto,
    tp/pp/dp/zero_stage, activation_checkpointing) and `data` (micro_batch_size,
    grad_accum_steps). Meant for a plan that fits (see require_fit)."""
    p = p or plan(cfg)
    data = cfg.model_dump()
    data["parallel"].update(p.parallel)
    data["parallel"]["strategy"] = p.strategy
    data["parallel"]["activation_checkpointing"] = p.activation_checkpointing
    data["data"]["micro_batch_size"] = p.micro_batch_size
    data["data"]["grad_accum_steps"] = p.grad_accum_steps
    if cfg.resource.elastic:  # dp and grad accumulation follow the size (at_world_size)
        data["parallel"]["dp"] = None
        data["data"]["grad_accum_steps"] = None
    return ExperimentConfig.model_validate(data)


# --------------------------------------------------------------------------- elastic runs


def _end_summary(p: Plan) -> dict[str, Any]:
    """What `plan --json` shows of one end of an elastic run's range."""
    return {
        "world_size": p.world_size,
        "nodes": p.nodes,
        "strategy": p.strategy,
        "parallel": p.parallel,
        "activation_checkpointing": p.activation_checkpointing,
        "micro_batch_size": p.micro_batch_size,
        "grad_accum_steps": p.grad_accum_steps,
        "global_batch_size": p.global_batch_size,
        "memory_per_device_bytes": {k: int(round(v)) for k, v in p.memory_per_device_bytes.items()},
        "fits": p.fits,
    }


def plan_elastic(cfg: ExperimentConfig) -> Plan:
    """An elastic run's plan: the layout is chosen at its largest size (what it
    starts with when Ray can place every worker); the smallest size keeps that
    tp x pp, ZeRO stage, recomputation and micro batch with a smaller dp and more
    gradient accumulation, and must fit too: with FSDP a smaller dp means larger
    shards per device, so the minimum is the end that may not fit. The plan is
    the largest size's, with `elastic: {min, max}` and fits only if both do."""
    from trainlab.errors import ConfigError

    r = cfg.resource
    top = _plan_fixed(cfg)
    ends = {"max": _end_summary(top)}
    if r.min_workers == r.max_workers:
        ends["min"] = ends["max"]
        top.elastic = {"min": ends["min"], "max": ends["max"]}
        return top
    smallest = min(r.allowed_world_sizes((top.parallel["tp"]) * top.parallel["pp"]))
    try:
        low_cfg = resolve_layout(cfg, top).at_world_size(smallest)
    except ConfigError as e:  # the chosen split does not divide at the smallest size
        top.fits = False
        top.notes.append(f"does not fit at the elastic minimum ({smallest} workers): {e}")
        top.elastic = {"min": {"world_size": smallest, "fits": False}, "max": ends["max"]}
        return top
    low = _plan_fixed(low_cfg)
    ends["min"] = _end_summary(low)
    top.elastic = {"min": ends["min"], "max": ends["max"]}
    top.notes.append(
        f"elastic: {smallest} to {r.max_workers} workers (multiples of tp x pp = "
        f"{top.parallel['tp'] * top.parallel['pp']}); at {smallest}: "
        f"dp={low.parallel['dp']}, grad_accum_steps {low.grad_accum_steps}, "
        f"{low.memory_per_device_bytes['total'] / GiB:.2f} GiB per device"
    )
    if not low.fits:
        top.fits = False
        why = next((n for n in low.notes if n.startswith("does not fit")), "does not fit")
        top.notes.append(
            f"does not fit at the elastic minimum (resource.num_workers.min = "
            f"{r.min_workers}, {smallest} workers): {why.removeprefix('does not fit: ')}"
        )
    return top
