"""The decoder-only language models trainlab trains (gpt2 and llama families).

`build_model(cfg.model)` gives an initialized `TransformerLM`; attention
implementations are chosen by name from `trainlab.models.attention`.
Importing this package imports torch: keep it out of validate/show/plan.
"""

from trainlab.models.attention import AttentionMask, available, get_attention, register
from trainlab.models.transformer import (
    TransformerLM,
    build_model,
    num_parameters,
    segment_positions,
)

__all__ = [
    "AttentionMask",
    "TransformerLM",
    "available",
    "build_model",
    "get_attention",
    "num_parameters",
    "register",
    "segment_positions",
]
