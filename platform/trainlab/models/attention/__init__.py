"""Attention implementations, chosen by name (`model.attention` in the config).

Adding a variant is a one-file change: put a module in this package whose
function is decorated with `@register("name")`. Modules here are discovered
automatically the first time a name is looked up, so nothing else needs
editing; `model.attention: name` then selects it.

An implementation takes queries `[B, H, T, D]`, keys and values
`[B, Hkv, T, D]` (grouped-query attention: `H` is a multiple of `Hkv`), the
`AttentionMask` of the batch and the dropout probability, and returns
`[B, H, T, D]`. It must be causal and must not let a token attend across
documents of a packed row (`mask.document_ids`, see docs/contracts.md).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trainlab.errors import UserError

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "AttentionMask", float], torch.Tensor
]

_REGISTRY: dict[str, AttentionFn] = {}
_discovered = False


@dataclass
class AttentionMask:
    """What attention may see, derived once per forward and shared by every layer.

    `document_ids` is `[B, T]` (-1 for padding) or None for unpacked rows, in
    which case plain causal attention applies.
    """

    seq_len: int
    document_ids: torch.Tensor | None = None
    _dense: torch.Tensor | None = field(default=None, repr=False)

    @property
    def is_plain_causal(self) -> bool:
        return self.document_ids is None

    def dense(self) -> torch.Tensor:
        """Boolean `[B|1, 1, T, T]`, True where query i may attend key j:
        j <= i and both tokens belong to the same document of the row."""
        if self._dense is None:
            t = self.seq_len
            device = self.document_ids.device if self.document_ids is not None else None
            causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
            if self.document_ids is None:
                self._dense = causal[None, None]
            else:
                ids = self.document_ids
                same_doc = ids[:, :, None] == ids[:, None, :]
                self._dense = (same_doc & causal)[:, None]
        return self._dense


def register(name: str) -> Callable[[AttentionFn], AttentionFn]:
    """Make `fn` selectable as `model.attention: name`."""

    def add(fn: AttentionFn) -> AttentionFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"attention {name!r} is registered twice")
        _REGISTRY[name] = fn
        return fn

    return add


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    _discovered = True


def available() -> list[str]:
    """Names of every attention implementation, sorted."""
    _discover()
    return sorted(_REGISTRY)


def get_attention(name: str) -> AttentionFn:
    """The implementation registered as `name`; a UserError names the choices."""
    _discover()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UserError(
            f"model.attention = {name!r}: unknown attention implementation; "
            f"available: {', '.join(available())}"
        ) from None


__all__ = ["AttentionFn", "AttentionMask", "available", "get_attention", "register"]
