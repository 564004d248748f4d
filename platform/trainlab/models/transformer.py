"""Compatibility re-export: the model code moved to `trainlab.models.layers`
(building blocks, `Block`, `TransformerLM`) and `trainlab.models.archs` (one
file per `model.arch`). New code should import from those (or use
`model.layers`, which every architecture has) instead of this module."""

from trainlab.models.layers import (
    Attention,
    Block,
    GeluMLP,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    TransformerLM,
    apply_rope,
    segment_positions,
)
from trainlab.models.registry import build_model, num_parameters

__all__ = [
    "Attention",
    "Block",
    "GeluMLP",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "TransformerLM",
    "apply_rope",
    "build_model",
    "num_parameters",
    "segment_positions",
]
