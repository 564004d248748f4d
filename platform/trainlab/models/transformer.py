"""A decoder-only language model for both families of `model.arch`.

- `gpt2`: learned absolute positions, LayerNorm, GELU MLP, biases everywhere.
- `llama`: rotary positions (RoPE), RMSNorm, SwiGLU MLP, grouped-query
  attention, no biases.

Token embeddings may be tied to the output projection (`tie_embeddings`).
The parameter count equals `trainlab.plan.count_params(cfg).total` exactly.

Packed rows (docs/contracts.md, section 3): `document_ids` make attention
block-diagonal; gpt2 looks its learned positions up relative to the first
token of each document segment in the row (so they stay below max_seq_len),
RoPE uses `position_ids` as given (only relative positions matter to it).

The model knows nothing of DDP/FSDP or precision: trainlab.train applies those
from outside.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainlab.config.schema import ModelConfig
from trainlab.models.attention import AttentionMask, get_attention


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


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "gpt2":
        return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
    return RMSNorm(cfg.hidden_size, cfg.norm_eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of RoPE (Su et al. 2021) for arbitrary position ids.

    The frequencies are computed on each call rather than kept in a buffer, so a
    model materialized from the meta device (checkpoint validation) needs no
    re-initialization beyond its state dict."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, bias = cfg.hidden_size, cfg.arch == "gpt2"
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
        self.head_dim = cfg.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        self.qkv = nn.Linear(h, h + 2 * kv_dim, bias=bias)
        self.out = nn.Linear(h, h, bias=bias)
        self.attend = get_attention(cfg.attention)
        self.dropout = cfg.dropout

    def forward(
        self, x: torch.Tensor, mask: AttentionMask, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        kv_dim = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([self.num_heads * self.head_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = self.attend(q, k, v, mask, self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class GeluMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = GeluMLP(cfg) if cfg.arch == "gpt2" else SwiGLU(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, mask: AttentionMask, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), mask, rope))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class TransformerLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embeddings = (
            nn.Embedding(cfg.max_seq_len, cfg.hidden_size) if cfg.arch == "gpt2" else None
        )
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta) if cfg.arch == "llama" else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = make_norm(cfg)
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
                is_residual = name.endswith(("attn.out", "mlp.proj"))
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
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
        for how position_ids and document_ids of packed rows are used)."""
        b, t = input_ids.shape
        mask = AttentionMask(t, document_ids)
        x = self.tok_embeddings(input_ids)
        rope = None
        if self.pos_embeddings is not None:
            if document_ids is not None:
                positions = segment_positions(document_ids)
            else:
                positions = torch.arange(t, device=input_ids.device).expand(b, t)
            x = x + self.pos_embeddings(positions)
        else:
            if position_ids is None:
                position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
            rope = self.rope(position_ids)
        x = self.dropout(x)
        for layer in self.layers:
            x = layer(x, mask, rope)
        return self.output(self.norm(x))


def build_model(cfg: ModelConfig) -> TransformerLM:
    """The model described by the config's model section, initialized."""
    return TransformerLM(cfg)


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
