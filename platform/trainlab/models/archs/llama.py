"""`llama`: rotary positions (RoPE), RMSNorm, SwiGLU MLP, grouped-query
attention, no biases (Touvron et al. 2023)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from trainlab.models.moe import expert_width, is_moe_layer, moe_layer_count, moe_params
from trainlab.models.registry import (
    Architecture,
    ConfigIssue,
    ModelSpec,
    ParamCount,
    ParamShape,
    register_arch,
)

if TYPE_CHECKING:
    from torch import nn

    from trainlab.models.layers import NormFactory


@register_arch("llama")
class Llama(Architecture):
    summary = "RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no biases"
    # model.moe: MoE layers in place of the SwiGLU MLP (trainlab.models.moe)
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
        """Llama-2-7B (h=4096, L=32, a=32, f=11008, V=32000, untied) gives 6,738,415,616.
        With model.moe, each MoE block's MLP is its router, routed and shared experts."""
        h, f = m.hidden_size, m.ffn_hidden_size
        norm = h  # RMSNorm weight only
        mlp = 3 * h * f  # gate, up, down (SwiGLU)
        extra = sum(math.prod(shape) for _, shape in self.layer_extra_params(m))
        dense = self.attention_params(m) + mlp + 2 * norm + extra
        count = ParamCount.of(m, per_layer=dense, final_norm=norm)
        moe = getattr(m, "moe", None)
        if moe is None:
            return count
        parts = moe_params(moe, h, f)
        moe_mlp = parts["router"] + parts["routed"] + parts["shared"]
        layers = count.layers + moe_layer_count(moe, m.num_layers) * (moe_mlp - mlp)
        return ParamCount(
            count.embedding, count.position, round(layers / m.num_layers), layers,
            count.final_norm, count.head, count.total - count.layers + layers,
        )  # fmt: skip

    def active_params(self, m: ModelSpec) -> int:
        """All parameters but the routed experts a token skips (num_experts - top_k
        of them in every MoE layer)."""
        total = self.count_params(m).total
        moe = getattr(m, "moe", None)
        if moe is None:
            return total
        skipped = (moe.num_experts - moe.top_k) * moe_params(moe, m.hidden_size, m.ffn_hidden_size)[
            "expert"
        ]
        return total - moe_layer_count(moe, m.num_layers) * skipped

    def moe_param_shapes(self, m: ModelSpec, prefix: str, layer: int) -> list[ParamShape] | None:
        moe = getattr(m, "moe", None)
        if not is_moe_layer(moe, layer):
            return None
        h, e = m.hidden_size, moe.num_experts
        f = expert_width(moe, m.ffn_hidden_size)
        pre = f"{prefix}.mlp"
        shapes = [
            ParamShape(f"{pre}.router.gate.weight", (e, h), layer, matmul=True),
            ParamShape(f"{pre}.experts.gate", (e, f, h), layer, matmul=True),
            ParamShape(f"{pre}.experts.up", (e, f, h), layer, matmul=True),
            ParamShape(f"{pre}.experts.down", (e, h, f), layer, matmul=True),
        ]
        if moe.shared_experts:
            s = moe.shared_experts * f
            shapes += [
                ParamShape(f"{pre}.shared.gate.weight", (s, h), layer, matmul=True),
                ParamShape(f"{pre}.shared.up.weight", (s, h), layer, matmul=True),
                ParamShape(f"{pre}.shared.proj.weight", (h, s), layer, matmul=True),
            ]
        return shapes

    def qk_norm(self, m: ModelSpec) -> NormFactory | None:
        """The per-head norm of queries and keys (none in Llama)."""
        return None

    def build(self, m: ModelSpec) -> nn.Module:
        from trainlab.models.layers import Attention, Block, RMSNorm, SwiGLU, TransformerLM

        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, m.norm_eps)

        qk_norm = self.qk_norm(m)
        moe = getattr(m, "moe", None)
        built = iter(range(m.num_layers))

        def mlp(index: int) -> nn.Module:
            if not is_moe_layer(moe, index):
                return SwiGLU(m)
            from trainlab.models.moe.layer import MoE

            width = expert_width(moe, m.ffn_hidden_size)
            return MoE(moe, m.hidden_size, width, moe_layer_count(moe, m.num_layers))

        def block() -> Block:
            h = m.hidden_size
            attn = Attention(m, bias=False, qk_norm=qk_norm)
            return Block(norm(h), attn, norm(h), mlp(next(built)), m.dropout)

        return TransformerLM(m, block=block, norm=norm, positions="rope")
