"""One optimizer step, and the loss it is built from.

Pure functions of a model, a batch and the config: the trainer decides when;
nothing here logs, checkpoints or talks to other parts.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from trainlab.config.schema import ExperimentConfig, ModelConfig
from trainlab.data import IGNORE_INDEX, Batch
from trainlab.models.loss import chunked_cross_entropy
from trainlab.models.moe.layer import finish_step
from trainlab.train.loop.schedule import lr_at
from trainlab.train.parallel import clip_grad_norm, gradient_sync

if TYPE_CHECKING:
    from trainlab.train.loop.state import ModelState

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "autocast_context",
    "concat",
    "fallback_batch",
    "local_value",
    "loss_context",
    "loss_sum_and_count",
    "one_document_rows",
    "to_step_tensors",
    "to_tensors",
    "train_step",
    "train_step_tensors",
]


def to_tensors(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v).to(device, non_blocking=True) for k, v in batch.items()}


def one_document_rows(batches: list[Batch]) -> bool:
    """Whether every row of every micro batch holds one document (or only padding):
    read on the host, from the loader's arrays, before anything goes to the device."""
    for b in batches:
        ids = b.get("document_ids")
        if ids is None:
            continue
        ids = np.asarray(ids)
        if ids.size and not (ids == ids[:, :1]).all():
            return False
    return True


def to_step_tensors(batches: list[Batch], device: torch.device) -> list[dict[str, torch.Tensor]]:
    """A step's micro batches on the device. When every row holds one document
    the document ids are left out: attention is then plain causal
    (`is_causal=True`, the flash kernel on CUDA, no mask built), which is what the
    block-diagonal mask of one document is (learned positions are the same too)."""
    drop = one_document_rows(batches)
    return [
        to_tensors({k: v for k, v in b.items() if not (drop and k == "document_ids")}, device)
        for b in batches
    ]


def loss_sum_and_count(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over the tokens whose label is not -100,
    and how many there were. The loss is taken `chunk` tokens at a time
    (`train.loss_chunk_tokens`, trainlab.models.loss; 0: at once); vocabulary-
    parallel logits (tensor parallelism: a DTensor under `loss_context`) take
    torch's loss_parallel cross-entropy, which holds only this rank's share of
    the vocabulary."""
    logits = model(
        batch["input_ids"],
        position_ids=batch.get("position_ids"),
        document_ids=batch.get("document_ids"),
    )
    labels = batch["labels"]
    if hasattr(logits, "placements"):  # a DTensor: tensor parallelism's sharded vocabulary
        loss = F.cross_entropy(
            logits.float().flatten(0, 1),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
    else:
        loss = chunked_cross_entropy(logits, labels, chunk)
    return loss, (labels != IGNORE_INDEX).sum()


def autocast_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast works on CPU too; fp16 is GPU-only (with a grad scaler)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a loss that may be a DTensor (tensor parallelism's loss)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def loss_context(m: ModelState) -> contextlib.AbstractContextManager:
    """Vocabulary-parallel cross-entropy on sharded logits under tensor parallelism
    (forward and backward must both run inside it)."""
    if not m.parallel.tensor_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def concat(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def train_step(
    m: ModelState,
    cfg: ExperimentConfig,
    step: int,
    micro_batches: list[Batch],
    device: torch.device,
) -> tuple[float, float]:
    """`train_step_tensors` read back as floats (a device-to-host sync: the
    training loop itself reads a step's values one step later, train.metrics)."""
    loss, norm = train_step_tensors(m, cfg, step, micro_batches, device)
    return float(loss), float(norm)


def train_step_tensors(
    m: ModelState,
    cfg: ExperimentConfig,
    step: int,
    micro_batches: list[Batch],
    device: torch.device,
    loss_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimizer step `step` (0-based) over this rank's micro batches: the loss is
    the mean over the step's labelled tokens of all data-parallel ranks (each rank
    scales its summed loss by dp / the step's labelled tokens, and the gradient
    reduction averages over dp), gradients are accumulated and synced on the last
    micro batch, clipped, applied. Returns (this rank's share of the loss x dp,
    global gradient norm): the replicas' values average to the step's loss. Under
    pipeline parallelism the loss is 0 on ranks without the last stage. Both are
    0-dim device tensors, not read back here (no device-to-host sync); the norm is
    the one before clipping. `loss_factor` multiplies the loss (and so the
    gradients): train.chaos's NaN and spike rehearsals.

    No host sync: the labelled-token count, the loss scale and the gradient norm
    stay on the device (a step that neither logs, evaluates nor checkpoints
    queues its work and returns: trainlab.train.loop.metrics reads its values
    one step late)."""
    lr = lr_at(step, cfg.train)
    m.optimizers.set_lr(lr)
    tensors = to_step_tensors(micro_batches, device)
    # Everything below stays on the device: no value is read back by the host
    # (tests/unit/train/test_host_sync.py counts the reads: zero).
    mine = sum((b["labels"] != IGNORE_INDEX).sum() for b in tensors)
    labelled = m.env.dp_sum(torch.as_tensor(mine, dtype=torch.float64, device=device))
    scale = (m.env.dp_size / labelled.clamp(min=1.0) * loss_factor).float()
    for layer in m.moe_layers:  # the aux loss is averaged over the step's tokens too
        layer.loss_scale = scale
    chunk = cfg.train.loss_chunk_tokens
    total = torch.zeros((), device=device)
    scaler, model = m.scaler, m.model
    with loss_context(m):
        if m.pipeline is not None:
            with autocast_context(cfg.train.precision, device):
                out = m.pipeline.run(concat(tensors), scale, backward=True, chunk=chunk)
            if out is not None:
                total = out
            m.pipeline.sync_tied_gradients()
        else:
            for i, batch in enumerate(tensors):
                with (
                    gradient_sync(model, i == len(tensors) - 1),
                    autocast_context(cfg.train.precision, device),
                ):
                    loss_sum, _ = loss_sum_and_count(model, batch, chunk)
                    loss = loss_sum * scale
                (scaler.scale(loss) if scaler else loss).backward()
                total += local_value(loss.detach())
    if m.parallel.experts is not None:  # expert parallelism: the experts' own sync
        m.parallel.experts.sync_grads(model)
    if scaler is not None:
        scaler.unscale_(m.optimizers.only())
    max_norm = cfg.train.grad_clip or float("inf")
    if m.parallel.sharded:  # tensor/pipeline parallel: norms over meshes and stages
        pp_group = m.pipeline.group if m.pipeline is not None else None
        norm = clip_grad_norm(m.parameters(), max_norm, pp_group, m.tied_copies())
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
            norm = norm.full_tensor()
    if scaler is not None:
        # A fused optimizer takes the scale and the inf flags as tensors: no host
        # read (torch.amp.GradScaler.step; the per-tensor loop reads found_inf).
        scaler.step(m.optimizers.only())
        scaler.update()
    else:
        m.optimizers.step()
    m.optimizers.zero_grad()
    if m.moe_layers:  # once per optimizer step, from the whole step's routing
        rate = cfg.model.moe.bias_update_rate
        m.moe_stats = finish_step(m.moe_layers, m.env.dp_sum, rate, device)
    return total.detach(), norm.detach()


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
