"""The decoder-only language models trainlab trains.

Architectures (`model.arch`) are chosen by name from
`trainlab.models.registry` (one file each in `trainlab.models.archs`),
attention implementations (`model.attention`) from `trainlab.models.attention`;
`build_model(cfg.model)` gives the initialized model.

Importing this package does not import torch (validate/show/plan stay
torch-free): the names below are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainlab.models.attention import AttentionMask, available, get_attention, register
    from trainlab.models.layers import TransformerLM, segment_positions
    from trainlab.models.measured import repeated_blocks
    from trainlab.models.registry import (
        Architecture,
        arch_names,
        arch_of,
        build_model,
        get_arch,
        num_parameters,
        register_arch,
    )

_LAZY = {
    "AttentionMask": "trainlab.models.attention",
    "available": "trainlab.models.attention",
    "get_attention": "trainlab.models.attention",
    "register": "trainlab.models.attention",
    "TransformerLM": "trainlab.models.layers",
    "segment_positions": "trainlab.models.layers",
    "Architecture": "trainlab.models.registry",
    "arch_names": "trainlab.models.registry",
    "arch_of": "trainlab.models.registry",
    "repeated_blocks": "trainlab.models.measured",
    "build_model": "trainlab.models.registry",
    "get_arch": "trainlab.models.registry",
    "num_parameters": "trainlab.models.registry",
    "register_arch": "trainlab.models.registry",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "Architecture",
    "AttentionMask",
    "TransformerLM",
    "arch_names",
    "arch_of",
    "available",
    "build_model",
    "get_arch",
    "get_attention",
    "num_parameters",
    "register",
    "register_arch",
    "repeated_blocks",
    "segment_positions",
]
