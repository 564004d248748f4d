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

The mask is built once per forward (`prepare_mask`, called by the model before
its blocks) and shared by every layer: `@register("name", needs="dense")` asks
for the `[B, 1, T, T]` boolean mask, `needs="block"` for FlexAttention's block
mask; each is built only for packed rows. `auto` (the default) is no kernel of
its own: `prepare_mask` resolves it per forward (trainlab.models.registry.
resolve_attention: FlexAttention on CUDA, SDPA elsewhere; docs/gpu.md).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainlab.errors import UserError

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "AttentionMask", float], torch.Tensor
]

_REGISTRY: dict[str, AttentionFn] = {}
# What each implementation needs built before the blocks: "dense", "block" or None.
_NEEDS: dict[str, str | None] = {}
# How a mask kind other than the dense one is built from document ids (the module
# of the kernel that reads it registers it: flex.py, "block").
_MASK_BUILDERS: dict[str, Callable[[torch.Tensor], Any]] = {}
_discovered = False


@dataclass
class AttentionMask:
    """What attention may see, derived once per forward and shared by every layer.

    `document_ids` is `[B, T]` (-1 for padding) or None for rows of one document
    each, where plain causal attention applies (the trainer drops them for such
    batches: trainlab.train.loop.step.to_step_tensors). `impl` is the
    implementation this forward runs (`auto` resolved). The dense and block
    masks are built by `prepare_mask` before the first block, so the blocks
    (and FSDP's per-block copies of this dataclass, and compiled blocks) only
    read them.
    """

    seq_len: int
    document_ids: torch.Tensor | None = None
    impl: str = "sdpa"
    _dense: torch.Tensor | None = field(default=None, repr=False)
    _block: Any = field(default=None, repr=False)

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

    def block(self) -> Any:
        """FlexAttention's `BlockMask` of causal-and-same-document attention
        (trainlab.models.attention.flex.block_mask): blocks of 128 x 128 with no
        allowed pair are skipped by the kernel; no `[T, T]` tensor is kept."""
        if self._block is None and self.document_ids is not None:
            _discover()
            self._block = _MASK_BUILDERS["block"](self.document_ids)
        return self._block


def prepare_mask(
    name: str, seq_len: int, document_ids: torch.Tensor | None, device: torch.device,
    dropout_p: float = 0.0,
) -> AttentionMask:
    """The forward's mask for `model.attention = name` on `device`: `auto`
    resolved, and the dense or block mask the implementation needs built now."""
    from trainlab.models.base import resolve_attention

    impl = resolve_attention(name, device.type == "cuda", dropout_p)
    _discover()
    mask = AttentionMask(seq_len, document_ids, impl)
    if document_ids is not None:
        needs = _NEEDS.get(impl)
        if needs == "dense":
            mask.dense()
        elif needs == "block":
            mask.block()
    return mask


def register(name: str, needs: str | None = None) -> Callable[[AttentionFn], AttentionFn]:
    """Make `fn` selectable as `model.attention: name`; `needs` ("dense",
    "block" or None) is the mask `prepare_mask` builds for it before the blocks."""

    def add(fn: AttentionFn) -> AttentionFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"attention {name!r} is registered twice")
        _REGISTRY[name] = fn
        _NEEDS[name] = needs
        return fn

    return add


def register_mask(kind: str) -> Callable[[Callable], Callable]:
    """Make `fn(document_ids) -> mask` the builder of the `kind` mask."""

    def add(fn: Callable) -> Callable:
        _MASK_BUILDERS[kind] = fn
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


__all__ = [
    "AttentionFn",
    "AttentionMask",
    "available",
    "get_attention",
    "prepare_mask",
    "register",
    "register_mask",
]
