"""`model.attention: auto` (the default): the implementation the device trains
fastest with, resolved once per forward (trainlab.models.registry.
resolve_attention, called by `prepare_mask`): FlexAttention with a block mask on
CUDA, SDPA elsewhere (FlexAttention has no backward on CPU) and wherever
dropout is on (FlexAttention has none). docs/gpu.md says which runs where."""

from __future__ import annotations

import torch

from trainlab.models.attention import AttentionMask, get_attention, register


@register("auto")
def auto_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float = 0.0
) -> torch.Tensor:
    return get_attention(mask.impl)(q, k, v, mask, dropout_p)
