"""Attention written out (scores, mask, softmax, weighted sum): the reference
the fused kernels are checked against, and the place to start a new variant."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from trainlab.models.attention import AttentionMask, register


@register("eager", needs="dense")
def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float = 0.0
) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # grouped-query attention: each kv head serves `groups` query heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask.dense(), float("-inf"))
    weights = F.softmax(scores.float(), dim=-1).to(q.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v
