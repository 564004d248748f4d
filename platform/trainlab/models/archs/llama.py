"""`llama`: rotary positions (RoPE), RMSNorm, SwiGLU MLP, grouped-query
attention, no biases (Touvron et al. 2023)."""

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

    from trainlab.models.layers import NormFactory


@register_arch("llama")
class Llama(Architecture):
    summary = "RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no biases"
    mlp_activation_factor = 8.0  # gate, its activation, up, product
    learned_positions = False

    def default_ffn_hidden_size(self, m: ModelSpec) -> int:
        """8/3 * hidden rounded up to a multiple of 256 (4096 -> 11008, Llama-2-7B)."""
        return 256 * -(-(8 * m.hidden_size // 3) // 256)

    def check(self, m: Mapping[str, Any]) -> Iterator[ConfigIssue]:
        h, a = m["hidden_size"], m["num_heads"]
        if h % a == 0 and (h // a) % 2:  # (heads not dividing hidden is a general rule)
            yield ConfigIssue(
                "model.num_heads",
                a,
                f"head dim hidden_size/num_heads = {h // a} "
                f"must be even for RoPE (arch {self.name})",
            )

    def attention_params(self, m: ModelSpec) -> int:
        h = m.hidden_size
        kv_dim = (m.num_kv_heads or m.num_heads) * (h // m.num_heads)
        return h * h + 2 * h * kv_dim + h * h  # q, k, v, o; no biases

    def count_params(self, m: ModelSpec) -> ParamCount:
        """Llama-2-7B (h=4096, L=32, a=32, f=11008, V=32000, untied) gives 6,738,415,616."""
        h, f = m.hidden_size, m.ffn_hidden_size
        norm = h  # RMSNorm weight only
        mlp = 3 * h * f  # gate, up, down (SwiGLU)
        return ParamCount.of(
            m, per_layer=self.attention_params(m) + mlp + 2 * norm, final_norm=norm
        )

    def qk_norm(self, m: ModelSpec) -> NormFactory | None:
        """The per-head norm of queries and keys (none in Llama)."""
        return None

    def build(self, m: ModelSpec) -> nn.Module:
        from trainlab.models.layers import Attention, Block, RMSNorm, SwiGLU, TransformerLM

        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, m.norm_eps)

        qk_norm = self.qk_norm(m)

        def block() -> Block:
            h = m.hidden_size
            attn = Attention(m, bias=False, qk_norm=qk_norm)
            return Block(norm(h), attn, norm(h), SwiGLU(m), m.dropout)

        return TransformerLM(m, block=block, norm=norm, positions="rope")
