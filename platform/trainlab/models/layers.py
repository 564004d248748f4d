"""Torch building blocks the architectures of `trainlab.models.archs` compose.

`TransformerLM` is a generic pre-norm decoder-only LM: token embeddings,
optional learned positions or RoPE, a stack of `Block`s, a final norm and the
output projection (optionally tied to the embedding). What differs between
architectures (norm, MLP, biases, position scheme, per-head q/k norms) is
passed in by the architecture's `build()`.

Packed rows (docs/contracts.md, section 3): `document_ids` make attention
block-diagonal (the mask, dense or FlexAttention's block mask, is built once
per forward and shared by every block: trainlab.models.attention); learned positions are looked up relative to the first token of
each document segment in the row (so they stay below max_seq_len), RoPE uses
`position_ids` as given (only relative positions matter to it).

The model knows nothing of DDP/FSDP or precision: trainlab.train applies those
from outside (per element of `model.layers`).

Parameter names and creation order are part of the checkpoint and
reproducibility contract: seeded initial weights must not change when this
module is refactored (tests/unit/models compare against fixed state-dict keys).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainlab.models.attention import AttentionMask, get_attention, prepare_mask
from trainlab.models.base import ModelSpec

# A norm over the last dimension, built from that dimension's size.
NormFactory = Callable[[int], nn.Module]
Rope = tuple[torch.Tensor, torch.Tensor]


def segment_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token relative to the first token of its segment in the row
    (a segment is a run of equal document ids), e.g. [0,0,0,1,1,-1] -> [0,1,2,0,1,0]."""
    b, t = document_ids.shape
    index = torch.arange(t, device=document_ids.device).expand(b, t)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32: under bf16 autocast the mean of squares loses too much.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    """cos/sin tables of RoPE (Su et al. 2021) for arbitrary position ids.

    The frequencies are computed on each call rather than kept in a buffer, so a
    model materialized from the meta device (checkpoint validation) needs no
    re-initialization beyond its state dict."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, position_ids: torch.Tensor) -> Rope:
        exponents = (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=position_ids.device)
            / self.head_dim
        )
        inv_freq = 1.0 / self.theta**exponents
        angles = position_ids[..., None].float() * inv_freq  # [B, T, D/2]
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, T, D]
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    """Multi-head attention with grouped-query heads (`num_kv_heads`), separate q, k
    and v projections (so tensor parallelism can shard each by heads), the
    implementation named by `model.attention`, and two hooks:

    - `bias`: biases on the q, k, v and output projections;
    - `qk_norm`: a norm factory applied per head (over head_dim) to queries and
      keys before RoPE (QK-norm as in OLMo-2/Qwen3); its modules are
      `q_norm` and `k_norm`, absent when None.
    """

    def __init__(self, cfg: ModelSpec, *, bias: bool, qk_norm: NormFactory | None = None):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
        self.head_dim = cfg.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        self.q = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k = nn.Linear(h, kv_dim, bias=bias)
        self.v = nn.Linear(h, kv_dim, bias=bias)
        self.out = nn.Linear(h, h, bias=bias)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm(self.head_dim), qk_norm(self.head_dim)
        self.attend = get_attention(cfg.attention)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, mask: AttentionMask, rope: Rope | None) -> torch.Tensor:
        b, t, _ = x.shape
        # Head counts from the projections' outputs: under tensor parallelism each
        # rank holds num_heads/tp query and num_kv_heads/tp key/value heads.
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = self.attend(q, k, v, mask, self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class GeluMLP(nn.Module):
    def __init__(self, cfg: ModelSpec, *, bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=bias)
        self.proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelSpec):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)).

    Takes its parts already built; construct them in argument order (norm,
    attention, norm, MLP) so parameters are created, and seeded weights drawn,
    in that order."""

    def __init__(
        self,
        attn_norm: nn.Module,
        attn: Attention,
        mlp_norm: nn.Module,
        mlp: nn.Module,
        dropout: float,
    ):
        super().__init__()
        self.attn_norm = attn_norm
        self.attn = attn
        self.mlp_norm = mlp_norm
        self.mlp = mlp
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: AttentionMask, rope: Rope | None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), mask, rope))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class TransformerLM(nn.Module):
    """A decoder-only LM composed from parts.

    `block()` builds one block (called num_layers times), `norm(dim)` the final
    norm; `positions` is "learned" (a table of max_seq_len rows), "rope" or None.
    Token embeddings are tied to the output projection when `tie_embeddings`.
    """

    def __init__(
        self,
        cfg: ModelSpec,
        *,
        block: Callable[[], nn.Module],
        norm: NormFactory,
        positions: str | None,
    ):
        super().__init__()
        if positions not in ("learned", "rope", None):
            raise ValueError(f"positions must be 'learned', 'rope' or None, not {positions!r}")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embeddings = (
            nn.Embedding(cfg.max_seq_len, cfg.hidden_size) if positions == "learned" else None
        )
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta) if positions == "rope" else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(block() for _ in range(cfg.num_layers))
        self.norm = norm(cfg.hidden_size)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, init_std), residual output projections scaled by
        1/sqrt(2 * layers) so the residual stream's variance does not grow with depth."""
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith(("attn.out", "mlp.proj", "mlp.shared.proj"))
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif hasattr(module, "init_weights"):  # stacked weights (MoE experts)
                module.init_weights(std, residual_std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm | RMSNorm):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[B, T, vocab]` for `input_ids` `[B, T]` (see the module docstring
        for how position_ids and document_ids of packed rows are used).

        A pipeline stage (trainlab.train.parallel.pipeline) is this module with the parts
        other stages own set to None: without `tok_embeddings` the first argument
        is the previous stage's hidden states `[B, T, hidden]`; without `output`
        the stage returns hidden states. `layers` may then be a ModuleDict keyed by
        the layers' original indices (so parameter names stay those of the whole
        model)."""
        if self.tok_embeddings is not None:
            b, t = input_ids.shape
            x = self.tok_embeddings(input_ids)
        else:
            x = input_ids
            b, t = x.shape[0], x.shape[1]
        # Built once here and shared by every block (trainlab.models.attention).
        dropout = self.cfg.dropout if self.training else 0.0
        mask = prepare_mask(self.cfg.attention, t, document_ids, x.device, dropout)
        rope = None
        if self.pos_embeddings is not None and self.tok_embeddings is not None:
            if document_ids is not None:
                positions = segment_positions(document_ids)
            else:
                positions = torch.arange(t, device=input_ids.device).expand(b, t)
            x = x + self.pos_embeddings(positions)
        elif self.rope is not None:
            if position_ids is None:
                position_ids = torch.arange(t, device=x.device).expand(b, t)
            rope = self.rope(position_ids)
        if self.tok_embeddings is not None:
            x = self.dropout(x)
        layers = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for layer in layers:
            x = layer(x, mask, rope)
        if self.output is None:
            return x
        return self.output(self.norm(x))


__all__ = [
    "Attention",
    "Block",
    "GeluMLP",
    "NormFactory",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "TransformerLM",
    "apply_rope",
    "segment_positions",
]
