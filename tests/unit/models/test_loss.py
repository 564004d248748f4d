"""The chunked cross-entropy (trainlab.models.loss) against torch's: loss and
gradients within float rounding, whatever the chunk, with ignored labels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainlab.models.loss import IGNORE_INDEX, chunked_cross_entropy


def _case(dtype: torch.dtype, tokens: int = 70, vocab: int = 1000):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, tokens // 2, vocab, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=g)
    labels[0, :5] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX
    return logits, labels


def _reference(logits: torch.Tensor, labels: torch.Tensor, scale: float):
    x = logits.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(
        x.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    (loss * scale).backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("chunk", [0, 16, 33, 70, 4096])
def test_equal_to_cross_entropy_in_fp32(chunk):
    logits, labels = _case(torch.float32)
    want_loss, want_grad = _reference(logits, labels, 0.37)
    x = logits.clone().requires_grad_(True)
    loss = chunked_cross_entropy(x.clone(), labels, chunk)  # the loss owns its input
    (loss * 0.37).backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(x.grad, want_grad, rtol=1e-6, atol=1e-9)
    with torch.no_grad():  # evaluation: no gradient kept, the same sum
        torch.testing.assert_close(
            chunked_cross_entropy(logits, labels, chunk), want_loss, rtol=1e-6, atol=0
        )


def test_bf16_logits_take_fp32_chunks_and_give_bf16_gradients():
    logits, labels = _case(torch.bfloat16)
    want_loss, want_grad = _reference(logits, labels, 1.0)
    x = logits.clone().requires_grad_(True)
    loss = chunked_cross_entropy(x.clone(), labels, 16)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(x.grad, want_grad, rtol=1e-2, atol=1e-3)
