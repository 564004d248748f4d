"""The planner: from a validated config to a parallel layout that fits.

It decides *where and how many*: tp/pp/dp and the ZeRO stage, the memory each
device needs, the largest micro batch that fits, and FLOPs per token for MFU.
`plan()` never raises for a layout that does not fit; it returns `fits=False`
with notes saying why, and `require_fit()` turns that into a user error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from trainlab.config.schema import ExperimentConfig
from trainlab.errors import UserError
from trainlab.plan.model_math import (
    GiB,
    activation_bytes,
    count_params,
    flops_per_token,
    model_state_bytes,
)

# Fraction of device memory the plan may fill; the rest absorbs allocator
# fragmentation, the CUDA context, communication buffers and temporaries.
SAFETY_MARGIN = 0.10
MAX_MICRO_BATCH = 65536


@dataclass
class Layout:
    tp: int
    pp: int
    dp: int
    zero_stage: int

    @property
    def strategy(self) -> str:
        return "ddp" if self.zero_stage <= 1 else "fsdp"


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

    def to_json(self) -> dict[str, Any]:
        mem = {k: int(round(v)) for k, v in self.memory_per_device_bytes.items()}
        return {
            "num_params": self.num_params,
            "params_breakdown": self.params_breakdown,
            "world_size": self.world_size,
            "strategy": self.strategy,
            "parallel": self.parallel,
            "memory_per_device_bytes": mem,
            "device_memory_bytes": int(self.device_memory_bytes),
            "usable_memory_bytes": int(self.usable_memory_bytes),
            "flops_per_token": int(round(self.flops_per_token)),
            "micro_batch_size": self.micro_batch_size,
            "micro_batch_size_max": self.micro_batch_size_max,
            "global_batch_size": self.global_batch_size,
            "tokens_per_step": self.tokens_per_step,
            "fits": self.fits,
            "notes": self.notes,
        }


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
    return total / r.num_workers, (
        f"CPU workers share this host's {total / GiB:.1f} GiB: "
        f"{total / r.num_workers / GiB:.1f} GiB each (set resource.cpu_memory_gb to override)"
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cfg: ExperimentConfig) -> list[Layout]:
    """Every legal layout, best first: least communication.

    Order: pipeline stages (across nodes, bubbles) cost most, then tensor
    parallelism (per-layer all-reduces, within a node), then ZeRO sharding of
    data parallelism (one reduce-scatter/all-gather per step). So sort by
    (pp, tp, zero_stage). Values the user set in `parallel` are constraints.
    """
    m, p, r = cfg.model, cfg.parallel, cfg.resource
    world = r.num_workers
    per_node = r.gpus_per_node if r.use_gpu else world
    kv = m.num_kv_heads or m.num_heads
    out = []
    for tp in _divisors(world):
        if tp > per_node or m.num_heads % tp or kv % tp or (p.tp and tp != p.tp):
            continue
        for pp in _divisors(world // tp):
            if m.num_layers % pp or (p.pp and pp != p.pp):
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


def _memory(cfg: ExperimentConfig, lay: Layout, micro_batch: int) -> dict[str, float]:
    m, t, p = cfg.model, cfg.train, cfg.parallel
    n = count_params(m).total
    mem = model_state_bytes(n, t.precision, lay.zero_stage, lay.dp, lay.tp * lay.pp)
    mem["activations"] = activation_bytes(
        m,
        cfg.data.seq_len,
        micro_batch,
        lay.tp,
        lay.pp,
        p.sequence_parallel and lay.tp > 1,
        p.activation_checkpointing,
        t.precision,
    )
    mem["total"] = mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"]
    return mem


def _max_micro_batch(cfg: ExperimentConfig, lay: Layout, usable: float) -> int:
    """Largest micro batch whose total fits (activations grow linearly in it)."""
    states = _memory(cfg, lay, 1)
    per_sample = states["activations"]
    room = usable - (states["total"] - per_sample)
    if room < per_sample:
        return 0
    return int(min(MAX_MICRO_BATCH, room // per_sample))


def plan(cfg: ExperimentConfig) -> Plan:
    """Plan the run. With `parallel.strategy: auto` pick the layout; otherwise check it."""
    m, r = cfg.model, cfg.resource
    pc = count_params(m)
    dev_mem, mem_note = device_memory_bytes(cfg)
    usable = dev_mem * (1 - SAFETY_MARGIN)
    mb = cfg.data.micro_batch_size
    notes = [mem_note, f"usable: {usable / GiB:.1f} GiB after a {SAFETY_MARGIN:.0%} safety margin"]

    if cfg.parallel.strategy == "auto":
        candidates = candidate_layouts(cfg)
        chosen, fits = None, False
        for lay in candidates:
            if _memory(cfg, lay, mb)["total"] <= usable:
                chosen, fits = lay, True
                break
        if chosen is None:
            if not candidates:
                chosen = Layout(1, 1, r.num_workers, 0)
                notes.append("no legal tp/pp/dp layout for the given constraints; showing dp only")
            else:
                # Show the layout that needs the least memory, and why it is not enough.
                chosen = min(candidates, key=lambda lay: _memory(cfg, lay, mb)["total"])
        skipped = candidates.index(chosen) if chosen in candidates else 0
        notes.append(_why(chosen, skipped, fits))
    else:
        p = cfg.parallel
        chosen = Layout(p.tp or 1, p.pp or 1, p.dp or r.num_workers, p.zero_stage or 0)
        fits = _memory(cfg, chosen, mb)["total"] <= usable
        notes.append(
            f"layout as configured: strategy {p.strategy}, tp={chosen.tp} pp={chosen.pp} "
            f"dp={chosen.dp} zero_stage={chosen.zero_stage}"
        )

    mem = _memory(cfg, chosen, mb)
    mb_max = _max_micro_batch(cfg, chosen, usable)
    if not fits:
        notes.append(
            f"does not fit: {mem['total'] / GiB:.2f} GiB per device > usable "
            f"{usable / GiB:.2f} GiB of {dev_mem / GiB:.2f} GiB device memory"
        )
    elif mb_max < mb:  # pragma: no cover - fits implies mb <= mb_max
        notes.append(f"micro batch {mb} exceeds the largest that fits ({mb_max})")
    if chosen.tp > 1 or chosen.pp > 1:
        notes.append("tp/pp > 1: trainlab executes DP/ZeRO/FSDP only; tp/pp execution comes later")
    gbs = mb * cfg.data.grad_accum_steps * chosen.dp
    return Plan(
        num_params=pc.total,
        params_breakdown=pc.as_dict(),
        world_size=r.num_workers,
        strategy=chosen.strategy,
        parallel={
            "tp": chosen.tp,
            "pp": chosen.pp,
            "dp": chosen.dp,
            "zero_stage": chosen.zero_stage,
        },
        memory_per_device_bytes=mem,
        device_memory_bytes=dev_mem,
        usable_memory_bytes=usable,
        flops_per_token=flops_per_token(m, cfg.data.seq_len),
        micro_batch_size=mb,
        micro_batch_size_max=mb_max,
        global_batch_size=gbs,
        tokens_per_step=gbs * cfg.data.seq_len,
        fits=fits,
        notes=notes,
    )


def _why(lay: Layout, skipped: int, fits: bool) -> str:
    what = f"tp={lay.tp} pp={lay.pp} dp={lay.dp} zero_stage={lay.zero_stage} ({lay.strategy})"
    if not fits:
        return f"nothing fits; the smallest footprint is {what}"
    if skipped == 0:
        return f"chose {what}: the least-communicating layout already fits"
    return (
        f"chose {what}: {skipped} layout(s) that communicate less do not fit "
        "(preference: ZeRO sharding over dp, then tp within a node, then pp)"
    )


def require_fit(p: Plan) -> None:
    """Raise a one-line user error when the plan does not fit its devices."""
    if not p.fits:
        reason = next((n for n in p.notes if n.startswith("does not fit")), "plan does not fit")
        raise UserError(f"plan: {reason}")


def resolve_layout(cfg: ExperimentConfig, p: Plan | None = None) -> ExperimentConfig:
    """A copy of `cfg` with `parallel` made concrete from the plan (strategy never auto)."""
    p = p or plan(cfg)
    data = cfg.model_dump()
    data["parallel"].update(p.parallel)
    data["parallel"]["strategy"] = p.strategy
    return ExperimentConfig.model_validate(data)
