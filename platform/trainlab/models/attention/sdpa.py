"""PyTorch's fused scaled-dot-product attention (the default)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainlab.models.attention import AttentionMask, register


@register("sdpa", needs="dense")
def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float = 0.0
) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if mask.is_plain_causal:
        # No explicit mask lets PyTorch pick its fastest causal kernel.
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa
        )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.dense(), dropout_p=dropout_p, enable_gqa=gqa
    )
