"""`gpt2`: learned absolute positions, LayerNorm, GELU MLP, biases everywhere,
plain multi-head attention (Radford et al. 2019)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from trainlab.models.registry import (
    Architecture,
    ConfigIssue,
    ModelSpec,
    ParamCount,
    register_arch,
)

if TYPE_CHECKING:
    from torch import nn


@register_arch("gpt2")
class GPT2(Architecture):
    summary = "learned positions, LayerNorm, GELU MLP, biases"
    mlp_activation_factor = 4.0  # fc output and its GELU
    learned_positions = True
    norm = "layer"
    bias = True

    def default_ffn_hidden_size(self, m: ModelSpec) -> int:
        return 4 * m.hidden_size

    def check(self, m: Mapping[str, Any]) -> Iterator[ConfigIssue]:
        kv = m["num_kv_heads"] or m["num_heads"]
        if kv != m["num_heads"]:
            yield ConfigIssue(
                "model.num_kv_heads",
                kv,
                f"arch gpt2 has no grouped-query attention; must equal model.num_heads "
                f"({m['num_heads']})",
            )

    def count_params(self, m: ModelSpec) -> ParamCount:
        """GPT-2 small (h=768, L=12, V=50257, T=1024, tied) gives 124,439,808."""
        h, f = m.hidden_size, m.ffn_hidden_size
        kv_dim = (m.num_kv_heads or m.num_heads) * (h // m.num_heads)
        norm = 2 * h  # LayerNorm weight + bias
        attn = (h * (h + 2 * kv_dim) + (h + 2 * kv_dim)) + (h * h + h)  # q, k, v + out, with biases
        mlp = (h * f + f) + (f * h + h)  # fc + proj, with biases
        return ParamCount.of(
            m, per_layer=attn + mlp + 2 * norm, final_norm=norm, position=m.max_seq_len * h
        )

    def build(self, m: ModelSpec) -> nn.Module:
        from torch import nn

        from trainlab.models.layers import Attention, Block, GeluMLP, TransformerLM

        def norm(dim: int) -> nn.Module:
            return nn.LayerNorm(dim, eps=m.norm_eps)

        def block() -> Block:
            h = m.hidden_size
            return Block(norm(h), Attention(m, bias=True), norm(h), GeluMLP(m), m.dropout)

        return TransformerLM(m, block=block, norm=norm, positions="learned")
