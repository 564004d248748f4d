"""`llama_qknorm`: Llama with QK-norm, an RMSNorm over head_dim applied to the
queries and keys of each head before RoPE (as in OLMo-2 and Qwen3; one weight
vector of head_dim shared by all heads for q, one for k, in every layer).
It bounds the attention logits, which keeps higher learning rates stable."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainlab.models.archs.llama import Llama
from trainlab.models.registry import ModelSpec, StepDtypes, register_arch

if TYPE_CHECKING:
    from trainlab.models.layers import NormFactory


@register_arch("llama_qknorm")
class LlamaQKNorm(Llama):
    summary = "Llama with RMSNorm on per-head queries and keys before RoPE"

    def attention_activation_terms(self, kv_ratio: float) -> float:
        # The q/k norms keep their 16-bit inputs: 2 + 2*g more bytes per s*b*h.
        return super().attention_activation_terms(kv_ratio) + 2 + 2 * kv_ratio

    def attention_saved_bytes(self, m: ModelSpec, d: StepDtypes, seq_len: int) -> float:
        """Llama's, plus the q and k norms (RMSNorm over head_dim of each head): the
        normed tensor in q's dtype, an fp32 copy of 16-bit q/k (in fp32 q/k are
        the projections' outputs, already kept) and rsqrt per head (4). Their outputs feed
        RoPE, which keeps none of its inputs."""
        h, a = m.hidden_size, m.num_heads
        kv_heads = m.num_kv_heads or a
        width = h + kv_heads * m.head_dim
        norms = ((0 if d.compute == 4 else 4) + d.compute) * width + 4 * (a + kv_heads)
        return super().attention_saved_bytes(m, d, seq_len) + norms

    def layer_extra_params(self, m: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
        """The q_norm and k_norm weights of one block (Llama.count_params counts them)."""
        return [("attn.q_norm.weight", (m.head_dim,)), ("attn.k_norm.weight", (m.head_dim,))]

    def qk_norm(self, m: ModelSpec) -> NormFactory | None:
        from trainlab.models.layers import RMSNorm

        return lambda head_dim: RMSNorm(head_dim, m.norm_eps)
