"""Mixture of experts on the built-in decoder (`model.moe`, docs/moe.md).

A block of an MoE model replaces its SwiGLU MLP with an `MoE` layer
(trainlab.models.moe.layer): a router picks `top_k` of `num_experts` routed
experts per token (trainlab.models.moe.router), the tokens are sorted by expert
(trainlab.models.moe.dispatch) and all experts run as one grouped matrix
multiply (trainlab.models.moe.experts); optional shared experts see every
token.

This module is torch-free (validate and plan read it): which layers are MoE,
the config checks, and the parameter counts the planner uses.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from trainlab.models.base import ConfigIssue

# The families whose MLP an MoE layer replaces (SwiGLU experts).
MOE_ARCHS = ("llama", "llama_qknorm")


def _get(moe: Any, key: str) -> Any:
    return moe[key] if isinstance(moe, Mapping) else getattr(moe, key)


def is_moe_layer(moe: Any, index: int) -> bool:
    """Whether block `index` is an MoE layer: after `first_dense_layers` dense
    blocks, every `every_n_layers`-th block (the first of them included)."""
    if moe is None:
        return False
    first, every = _get(moe, "first_dense_layers"), _get(moe, "every_n_layers")
    return index >= first and (index - first) % every == 0


def moe_layer_count(moe: Any, num_layers: int) -> int:
    return sum(is_moe_layer(moe, i) for i in range(num_layers))


def expert_width(moe: Any, ffn_hidden_size: int) -> int:
    """One expert's hidden width: `expert_ffn_hidden_size`, else model.ffn_hidden_size."""
    return _get(moe, "expert_ffn_hidden_size") or ffn_hidden_size


def moe_params(moe: Any, hidden: int, ffn_hidden_size: int) -> dict[str, int]:
    """Parameters of one MoE layer's parts: the router, all routed experts, one
    routed expert, the shared experts (SwiGLU: gate, up, down per expert)."""
    f = expert_width(moe, ffn_hidden_size)
    one = 3 * hidden * f
    return {
        "router": _get(moe, "num_experts") * hidden,
        "routed": _get(moe, "num_experts") * one,
        "expert": one,
        "shared": _get(moe, "shared_experts") * one,
    }


def moe_checks(m: Mapping[str, Any]) -> Iterator[ConfigIssue]:
    """Problems of `model.moe` in the plain model-section dict, one per line."""
    moe = m.get("moe")
    if not moe:
        return
    if m["arch"] not in MOE_ARCHS:
        yield ConfigIssue(
            "model.moe", "set",
            f"MoE layers are built for the SwiGLU families ({', '.join(MOE_ARCHS)}), "
            f"not arch {m['arch']!r}",
        )  # fmt: skip
        return
    e, k = moe["num_experts"], moe["top_k"]
    if k > e:
        yield ConfigIssue("model.moe.top_k", k, f"must be <= model.moe.num_experts ({e})")
    cf = moe.get("capacity_factor")
    if cf is not None and cf < 1.0:
        yield ConfigIssue(
            "model.moe.capacity_factor", cf,
            "must be >= 1 (or null: dropless); below 1 even perfect balance drops tokens",
        )  # fmt: skip
    width = moe.get("expert_ffn_hidden_size") or m.get("ffn_hidden_size")
    if width is not None and width % 8:
        yield ConfigIssue(
            "model.moe.expert_ffn_hidden_size", width,
            "must be a multiple of 8 (the grouped GEMM's row alignment)",
        )  # fmt: skip
    if m["hidden_size"] % 8:
        yield ConfigIssue(
            "model.hidden_size", m["hidden_size"],
            "must be a multiple of 8 with model.moe (the grouped GEMM's row alignment)",
        )  # fmt: skip
    if moe_layer_count(moe, m["num_layers"]) == 0:
        yield ConfigIssue(
            "model.moe.first_dense_layers", moe["first_dense_layers"],
            f"leaves no MoE layer among model.num_layers ({m['num_layers']})",
        )  # fmt: skip


__all__ = [
    "MOE_ARCHS",
    "expert_width",
    "is_moe_layer",
    "moe_checks",
    "moe_layer_count",
    "moe_params",
]
