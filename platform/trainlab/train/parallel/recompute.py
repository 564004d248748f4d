"""Activation checkpointing (`parallel.activation_checkpointing`): `full`
recomputes every block in backward, `selective` every other block (layer-wise
selective, as in torchtitan) and keeps, in those, the attention kernel's
outputs (its output and log-sum-exp: torchtitan's save list), so backward
recomputes the projections, norms and MLP but not the attention itself, the
costliest op of a long row and the one whose recomputation needs the mask.
`trainlab.plan.memory` counts the kept outputs (`Architecture.attention_kept_bytes`)."""

from __future__ import annotations

from functools import partial

from torch import nn

from trainlab.train.parallel.blocks import blocks


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
    extra = {"context_fn": _keep_attention_contexts} if mode == "selective" else {}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra
        ),
        check_fn=lambda m: id(m) in chosen,
    )


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
