"""A worked user architecture: a parallel-block decoder with ALiBi positions.

Nothing among trainlab's built-in families (llama, llama_qknorm, gpt2) looks like
it, which is the point: it shows how to train your own model with trainlab without
changing trainlab. A config selects it with

    model:
      arch: parallel_alibi:ParallelAlibi   # MODULE:NAME
      code_dir: ../models                  # where MODULE is imported from
      options: {alibi_max_bias: 8.0}       # checked by ParallelAlibi.options_model

The model:
- parallel blocks (GPT-J / PaLM): attention and MLP read the same normed input and
  their sum is added to the residual (`parallel_residual: false`: the usual
  sequential pre-norm block, for comparison);
- ALiBi (Press et al. 2022): no position embedding; each head adds
  -slope * (query position - key position) to its attention scores, with slopes
  2^(-max_bias * i / heads), i = 1..heads. The distance comes from `position_ids`,
  which restart at 0 at each packed document;
- LayerNorm without bias (or RMSNorm), a squared-ReLU MLP, no biases anywhere,
  weights drawn from N(0, init_std), the output tied to the embedding if asked.

How trainlab uses it: `build(m)` is called with the model section `m`, once on the
meta device (parameter counts, FLOPs and activation memory are measured there, so
the model must build and run on meta tensors) and once for real. The blocks sit in
one nn.ModuleList (`layers`): FSDP wraps and recomputation replays them one by one.
The forward follows trainlab's contract: `model(input_ids, position_ids=None,
document_ids=None) -> logits [B, T, vocab]`, where a token attends only to earlier
tokens of its own document. `export` writes the weights for `trainlab export`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from trainlab.models import Architecture

SECTION_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
    "ffn_hidden_size", "max_seq_len", "tie_embeddings", "norm_eps", "init_std", "dropout",
)  # fmt: skip


class Options(BaseModel):
    """`model.options` of this architecture (an unknown key or a wrong type is an error)."""

    model_config = ConfigDict(extra="forbid")
    alibi_max_bias: float = Field(8.0, gt=0)  # steepest slope 2^-(max_bias / heads)
    parallel_residual: bool = True
    norm: Literal["layer", "rms"] = "layer"


def alibi_bias(position_ids: torch.Tensor, num_heads: int, max_bias: float) -> torch.Tensor:
    """[B, H, T, T] float: -slope_h * (pos_query - pos_key), made on the fly (no buffer,
    so a model built on the meta device needs nothing beyond its state dict)."""
    i = torch.arange(1, num_heads + 1, dtype=torch.float32, device=position_ids.device)
    slopes = torch.exp2(-max_bias * i / num_heads)
    pos = position_ids.float()
    distance = (pos[:, :, None] - pos[:, None, :]).abs()  # [B, T, T]
    return -slopes[None, :, None, None] * distance[:, None]


def allowed(document_ids: torch.Tensor | None, t: int, device: torch.device) -> torch.Tensor:
    """Boolean [B|1, 1, T, T]: key j <= query i, both of the same document."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    if document_ids is None:
        return causal[None, None]
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]


class Attention(nn.Module):
    def __init__(self, m: Any):
        super().__init__()
        self.heads, self.kv_heads = m.num_heads, m.num_kv_heads or m.num_heads
        self.head_dim = m.hidden_size // m.num_heads
        self.q = nn.Linear(m.hidden_size, self.heads * self.head_dim, bias=False)
        self.k = nn.Linear(m.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(m.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(self.heads * self.head_dim, m.hidden_size, bias=False)
        self.dropout = m.dropout

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.kv_heads != self.heads:  # grouped-query attention
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=p)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, m: Any, opts: Options):
        super().__init__()
        norm = (
            (lambda: nn.LayerNorm(m.hidden_size, eps=m.norm_eps, bias=False))
            if opts.norm == "layer"
            else (lambda: nn.RMSNorm(m.hidden_size, eps=m.norm_eps))
        )
        self.parallel = opts.parallel_residual
        self.attn_norm = norm()
        self.attn = Attention(m)
        self.mlp_norm = None if self.parallel else norm()  # parallel: one shared norm
        self.fc = nn.Linear(m.hidden_size, m.ffn_hidden_size, bias=False)
        self.proj = nn.Linear(m.ffn_hidden_size, m.hidden_size, bias=False)
        self.drop = nn.Dropout(m.dropout)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.relu(self.fc(x)).square())  # squared ReLU (So et al. 2021)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        if self.parallel:
            return x + self.drop(self.attn(h, bias) + self.mlp(h))
        x = x + self.drop(self.attn(h, bias))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class ParallelAlibiLM(nn.Module):
    def __init__(self, m: Any, opts: Options):
        super().__init__()
        self.heads, self.max_bias = m.num_heads, opts.alibi_max_bias
        self.section = {f: getattr(m, f) for f in SECTION_FIELDS} | {"options": opts.model_dump()}
        self.tok_embeddings = nn.Embedding(m.vocab_size, m.hidden_size)
        self.drop = nn.Dropout(m.dropout)
        self.layers = nn.ModuleList(Block(m, opts) for _ in range(m.num_layers))
        self.norm = (
            nn.LayerNorm(m.hidden_size, eps=m.norm_eps, bias=False)
            if opts.norm == "layer"
            else nn.RMSNorm(m.hidden_size, eps=m.norm_eps)
        )
        self.output = nn.Linear(m.hidden_size, m.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=m.init_std)
        if m.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, t = input_ids.shape
        if position_ids is None:  # distances within a document are the same either way
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        # One additive mask for every block: ALiBi, and -inf where attention is not allowed.
        bias = alibi_bias(position_ids, self.heads, self.max_bias)
        bias = bias.masked_fill(~allowed(document_ids, t, input_ids.device), float("-inf"))
        x = self.drop(self.tok_embeddings(input_ids))
        for layer in self.layers:
            x = layer(x, bias)
        return self.output(self.norm(x))


class ParallelAlibi(Architecture):
    summary = "parallel attention+MLP blocks, ALiBi positions, squared-ReLU MLP"
    options_model = Options

    def build(self, m: Any) -> nn.Module:
        return ParallelAlibiLM(m, Options.model_validate(m.options or {}))

    def isolates_documents(self, m: Any) -> str | None:
        return None  # the -inf mask keeps each packed document to itself

    def export(self, model: nn.Module, out_dir: Any) -> None:
        """model.safetensors (tied tensors stored once) and config.json (the model section)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors, seen = {}, set()
        for name, t in model.state_dict().items():
            if t.data_ptr() in seen:  # the tied output weight: the embedding holds it
                continue
            seen.add(t.data_ptr())
            tensors[name] = t.detach().to("cpu").contiguous().clone()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = {"arch": "parallel_alibi:ParallelAlibi", **model.section}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
