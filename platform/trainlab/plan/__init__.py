"""The planner: parameter count, memory per device, parallel layout, FLOPs per token."""

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
    "Layout",
    "ParamCount",
    "Plan",
    "activation_bytes",
    "activation_bytes_per_layer",
    "count_params",
    "flops_per_token",
    "model_state_bytes",
    "plan",
    "require_fit",
    "resolve_layout",
]
