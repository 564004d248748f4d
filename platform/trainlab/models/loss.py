"""Next-token cross-entropy over chunks of tokens: never the whole logits in fp32.

`F.cross_entropy(logits.float(), ...)` on a micro batch of 16-bit logits makes
their fp32 copy and the fp32 log-softmax, both kept for backward (10 bytes per
logit; 65,536 tokens x a 128,256 vocabulary: 84 GB), and the fp32 gradients at
the start of backward. `chunked_cross_entropy` goes through the tokens
`chunk` rows at a time: each chunk's logits are cast to fp32, the chunk's loss
summed, and its fp32 temporaries freed before the next. Backward runs the same
chunks again (softmax minus the one-hot label, times the upstream gradient, in
fp32) and writes each chunk's gradient, in the logits' dtype, over that chunk
of the logits themselves: the gradient is the logits' buffer, so the loss keeps
2 bytes per logit (bf16) from its forward to the output projection's backward,
plus one chunk's fp32 working set (its fp32 copy and its exponentials: the
planner's term, trainlab.plan.memory).

The logits are the model's output and nothing else reads them after the loss;
the function owns them from then on (do not use `logits` after a backward
through it). Loss and gradients equal `F.cross_entropy(..., reduction="sum")`
within float rounding (tests/unit/models/test_loss.py: 1e-6 relative in fp32).
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "chunked_cross_entropy"]


def _softmax_rows(lf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax of `lf`'s rows, their log-sum-exp), with one fp32 temporary."""
    top = lf.amax(dim=-1, keepdim=True)
    e = (lf - top).exp_()
    total = e.sum(dim=-1, keepdim=True)
    e.div_(total)
    return e, (total.log_() + top).squeeze(-1)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], chunk):
            lf = logits[start : start + chunk].float()
            y = labels[start : start + chunk]
            keep = y != IGNORE_INDEX
            safe = torch.where(keep, y, 0)
            top = lf.amax(dim=-1)
            lse = (lf - top[:, None]).exp_().sum(dim=-1).log_() + top
            picked = lf.gather(1, safe[:, None]).squeeze(1)
            total = total + torch.where(keep, lse - picked, 0.0).sum()
            del lf
        ctx.chunk = chunk
        ctx.save_for_backward(logits, labels)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, labels = ctx.saved_tensors
        g = grad_total.float()
        for start in range(0, logits.shape[0], ctx.chunk):
            part = logits[start : start + ctx.chunk]
            y = labels[start : start + ctx.chunk]
            keep = y != IGNORE_INDEX
            p, _ = _softmax_rows(part.float())
            rows = torch.arange(p.shape[0], device=p.device)
            p[rows, torch.where(keep, y, 0)] -= 1.0
            p.mul_(torch.where(keep, g, 0.0)[:, None])
            part.copy_(p)  # the gradient overwrites the chunk's logits (module docstring)
            del p
        return logits, None, None


def chunked_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, chunk: int = 0
) -> torch.Tensor:
    """Summed cross-entropy of `logits` `[..., vocab]` against `labels` `[...]`,
    ignoring IGNORE_INDEX, `chunk` tokens at a time (0: all at once). fp32."""
    flat = logits.reshape(-1, logits.shape[-1])
    y = labels.reshape(-1)
    chunk = chunk if chunk > 0 else max(flat.shape[0], 1)
    if not (torch.is_grad_enabled() and flat.requires_grad):
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        for start in range(0, flat.shape[0], chunk):
            lf = flat[start : start + chunk].float()
            total = total + torch.nn.functional.cross_entropy(
                lf, y[start : start + chunk], ignore_index=IGNORE_INDEX, reduction="sum"
            )
        return total
    return _ChunkedCrossEntropy.apply(flat, y, chunk)
