"""Activation checkpointing (`parallel.activation_checkpointing`): `full`
recomputes every block in backward, `selective` every other block (layer-wise
selective, as in torchtitan)."""

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
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda m: id(m) in chosen,
    )
