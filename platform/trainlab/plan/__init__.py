"""The planner: parameter count, memory per device, parallel layout, FLOPs per token.

`memory` is the trainer's memory model (what trainlab.train allocates, by
category); `trace` checks it by tracing the real training step at full size on
fake tensors (it imports torch when called, not when imported). `model_math`
keeps the papers' formulas (ZeRO, Korthikanti) as references."""

from trainlab.plan.memory import CATEGORIES, MemoryEstimate, estimate_memory, memory_breakdown
from trainlab.plan.model_math import (
    ParamCount,
    activation_bytes,
    activation_bytes_per_layer,
    count_params,
    flops_per_token,
    model_state_bytes,
)
from trainlab.plan.planner import Layout, Plan, plan, require_fit, resolve_layout

__all__ = [
    "CATEGORIES",
    "Layout",
    "MemoryEstimate",
    "ParamCount",
    "Plan",
    "activation_bytes",
    "activation_bytes_per_layer",
    "count_params",
    "estimate_memory",
    "flops_per_token",
    "memory_breakdown",
    "model_state_bytes",
    "plan",
    "require_fit",
    "resolve_layout",
]
