"""One optimizer step, and the loss it is built from.

Pure functions of a model, a batch and the config: the trainer decides when;
nothing here logs, checkpoints or talks to other parts.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainlab.config.schema import ExperimentConfig, ModelConfig
from trainlab.data import IGNORE_INDEX, Batch
from trainlab.train.parallel import gradient_sync
from trainlab.train.schedule import lr_at

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "autocast_context",
    "fallback_batch",
    "loss_sum_and_count",
    "to_tensors",
    "train_step",
]


def to_tensors(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v).to(device, non_blocking=True) for k, v in batch.items()}


def loss_sum_and_count(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over the tokens whose label is not -100,
    and how many there were."""
    logits = model(
        batch["input_ids"],
        position_ids=batch.get("position_ids"),
        document_ids=batch.get("document_ids"),
    )
    labels = batch["labels"]
    loss = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, (labels != IGNORE_INDEX).sum()


def autocast_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast works on CPU too; fp16 is GPU-only (with a grad scaler)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    cfg: ExperimentConfig,
    step: int,
    micro_batches: list[Batch],
    device: torch.device,
) -> tuple[float, float]:
    """Optimizer step `step` (0-based) over this rank's micro batches: the loss is
    averaged over the rank's labelled tokens, gradients are accumulated and synced
    on the last micro batch, clipped, applied. Returns (local mean loss, global
    gradient norm)."""
    lr = lr_at(step, cfg.train)
    for group in optimizer.param_groups:
        group["lr"] = lr
    tensors = [to_tensors(mb, device) for mb in micro_batches]
    labelled = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in tensors)
    total = torch.zeros((), device=device)
    for i, batch in enumerate(tensors):
        with (
            gradient_sync(model, i == len(tensors) - 1),
            autocast_context(cfg.train.precision, device),
        ):
            loss_sum, _ = loss_sum_and_count(model, batch)
            loss = loss_sum / max(labelled, 1)
        (scaler.scale(loss) if scaler else loss).backward()
        total += loss.detach()
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip or float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
        norm = norm.full_tensor()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total.item(), float(norm)


def fallback_batch(m: ModelConfig, seq_len: int, seed: int) -> Batch:
    """A fixed batch of token ids for checkpoint validation when the dataset has
    no held-out split (val_fraction 0)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, m.vocab_size, size=(2, seq_len), dtype=np.int64)
    return {
        "input_ids": ids,
        "labels": np.roll(ids, -1, axis=1),
        "position_ids": np.tile(np.arange(seq_len, dtype=np.int64), (2, 1)),
        "document_ids": np.zeros((2, seq_len), dtype=np.int32),
    }
