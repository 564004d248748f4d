"""The transformer blocks of a model (or a pipeline stage): what recomputation,
FSDP and replicate wrap one by one."""

from __future__ import annotations

from torch import nn


def blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of `model.layers` (a list, or a pipeline stage's dict)."""
    layers = model.layers
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
