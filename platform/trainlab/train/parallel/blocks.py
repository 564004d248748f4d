"""The repeated blocks of a model (or a pipeline stage): what recomputation,
FSDP and replicate wrap one by one."""

from __future__ import annotations

from torch import nn

from trainlab.models.measured import repeated_blocks


def blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of `model.layers` (a list, or a pipeline stage's dict), or the
    repeated blocks of any other architecture (trainlab.models.measured)."""
    return repeated_blocks(model)
