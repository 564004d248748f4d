"""Activation checkpointing (`parallel.activation_checkpointing`): `full`
recomputes every block in backward, `selective` every other block (layer-wise
selective, as in torchtitan) and keeps, in those, the attention kernel's
outputs (its output and log-sum-exp: torchtitan's save list), so backward
recomputes the projections, norms and MLP but not the attention itself, the
costliest op of a long row and the one whose recomputation needs the mask.
`trainlab.plan.memory` counts the kept outputs (`Architecture.attention_kept_bytes`).

A block with an MoE layer (model.moe) records its routing statistics in forward
(trainlab.models.moe.layer); its recomputation runs inside
`trainlab.models.moe.layer.recomputing()`, so the statistics count each token
once. Only those blocks get that context (in the checkpoint's `context_fn`):
the others keep the plain checkpoint, which `torch.compile` traces as one graph
(an MoE block's statistics are a side effect dynamo does not trace inside a
checkpoint: compiled, its checkpoint runs eagerly around the compiled code)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

from torch import nn

from trainlab.models.moe.layer import MoE, recomputing
from trainlab.train.parallel.blocks import blocks

Contexts = tuple[AbstractContextManager, AbstractContextManager]


def apply(model: nn.Module, mode: str) -> None:
    """Recompute blocks (the elements of `model.layers`) in backward."""
    if mode == "none" or not blocks(model):
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    every = 1 if mode == "full" else 2
    chosen = {id(b) for i, b in enumerate(blocks(model)) if i % every == 0}

    def wrap(block: nn.Module) -> nn.Module:
        moe = any(isinstance(m, MoE) for m in block.modules())
        contexts = _contexts(mode == "selective", moe)
        extra = {"context_fn": contexts} if contexts is not None else {}
        return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra)

    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: id(m) in chosen
    )


def _contexts(selective: bool, moe: bool) -> Callable[[], Contexts] | None:
    """The checkpoint's context_fn for a block: None (the plain checkpoint), the
    selective save list's, and for an MoE block either wrapped so that its
    recomputation runs inside `recomputing()`."""
    if not moe:
        return _keep_attention_contexts if selective else None
    return _moe_selective_contexts if selective else _moe_full_contexts


def _moe_full_contexts() -> Contexts:
    return contextlib.nullcontext(), recomputing()


def _moe_selective_contexts() -> Contexts:
    forward, again = _keep_attention_contexts()
    return forward, _both(again, recomputing())


@contextlib.contextmanager
def _both(first: AbstractContextManager, second: AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield


def _attention_ops() -> set:
    """The fused attention kernels whose outputs `selective` keeps: SDPA's (per
    backend) and FlexAttention's."""
    import torch

    aten = torch.ops.aten
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    if flex is not None:
        ops.add(flex)
    return ops


def _keep_attention_contexts():  # -> the two contexts of a selective checkpoint
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kept = _attention_ops()

    def policy(ctx, op, *args, **kwargs):  # noqa: ANN001, ANN202
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
