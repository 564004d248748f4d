"""The router of an MoE layer: token-choice top-k over `num_experts` scores.

`score: softmax` (Switch, Mixtral, Qwen3-MoE) or `sigmoid` (DeepSeek-V3);
`normalize_top_k` rescales the chosen experts' weights to sum 1. With
aux-loss-free balancing (`balance: bias`, DeepSeek-V3) a per-expert bias, a
buffer in the state dict (so it is checkpointed), is added to the scores for
the choice only: the weights stay the scores themselves. The bias is changed
once per optimizer step by trainlab.models.moe.layer.finish_step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class Routing(NamedTuple):
    """The router's decision for N tokens."""

    experts: torch.Tensor  # [N, k] chosen expert ids (int64)
    weights: torch.Tensor  # [N, k] their weights (fp32)
    probs: torch.Tensor  # [N, E] the scores normalized to sum 1 per token (fp32)


class Router(nn.Module):
    def __init__(
        self, hidden: int, num_experts: int, top_k: int, score: str, normalize: bool, bias: bool
    ):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.score, self.normalize = score, normalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        # Persistent: in the state dict, so a checkpoint keeps it (None: no bias).
        self.register_buffer(
            "expert_bias", torch.zeros(num_experts, dtype=torch.float32) if bias else None
        )

    def forward(self, x: torch.Tensor) -> Routing:
        """Route `x` [N, hidden]: the logits in fp32 (a bf16 softmax over experts
        ties and flips choices), top-k by score (+ bias), weights from the score."""
        logits = self.gate(x).float()
        softmax = self.score == "softmax"
        scores = torch.softmax(logits, dim=-1) if softmax else torch.sigmoid(logits)
        choose = scores if self.expert_bias is None else scores + self.expert_bias
        experts = choose.topk(self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, experts)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-20)
        probs = scores if softmax else scores / scores.sum(-1, keepdim=True)
        return Routing(experts, weights, probs)
