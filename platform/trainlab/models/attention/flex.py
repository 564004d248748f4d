"""FlexAttention (torch.nn.attention.flex_attention) with a block mask: the
packed rows' causal-and-same-document attention without a `[T, T]` mask.

The block mask (`block_mask`) is built once per forward from `document_ids`
(trainlab.models.attention.prepare_mask) and shared by every layer; pairs of
128 x 128 blocks in which no query may see any key (above the diagonal, or in
different documents) are skipped by the kernel, and the blocks wholly inside
one document are run without evaluating the mask. Rows of one document each
(no `document_ids`: the trainer drops them for such batches) run SDPA with
`is_causal=True`, the flash kernel.

On CUDA the kernel is compiled once (`torch.compile(flex_attention)`; inside a
compiled block it is compiled with the block), and `create_block_mask` is
compiled too, so it never materialises the `[B, T, T]` mask either. On CPU
FlexAttention runs forward only (torch raises `NotImplementedError` for its
backward there): a CPU training run cannot use `flex` (a validate error,
trainlab.config.rules); evaluation and inference can (`torch.no_grad()`), and
give SDPA's logits (tests/unit/models/test_attention.py). No dropout: the
config refuses `flex` with `model.dropout > 0` and `auto` picks SDPA then.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from trainlab.models.attention import AttentionMask, register, register_mask


@register_mask("block")
def block_mask(document_ids: torch.Tensor) -> Any:
    """The `BlockMask` of `[B, T]` document ids: query i sees key j when j <= i and
    both are in the same document of the row (padding, -1, sees only padding)."""
    from torch.nn.attention.flex_attention import create_block_mask

    ids = document_ids
    b, t = ids.shape

    def causal_same_document(batch: Any, head: Any, q: Any, kv: Any) -> Any:
        return (q >= kv) & (ids[batch, q] == ids[batch, kv])

    # Compiled on CUDA (once per shape): the eager path evaluates the mask over all
    # T x T pairs at once.
    return create_block_mask(
        causal_same_document, b, None, t, t, device=ids.device, _compile=ids.is_cuda
    )


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: Any, gqa: bool) -> Any:
    """The kernel call: compiled on CUDA (the eager path is a slow reference that
    materialises the scores), eager elsewhere and inside a compiled block."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():
        fn = _compiled_flex()
    return fn(q, k, v, block_mask=blocks, enable_gqa=gqa)


@register("flex", needs="block")
def flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout_p: float = 0.0
) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if mask.is_plain_causal:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa
        )
    if dropout_p > 0.0:
        raise ValueError("flex attention has no dropout (model.dropout must be 0 with flex)")
    return _flex(q, k, v, mask.block(), gqa)
