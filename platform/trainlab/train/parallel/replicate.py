"""Data parallelism by full replicas (DDP, ZeRO-0/1, `parallel.strategy: ddp`).

Alone: torch's DistributedDataParallel (gradient buckets all-reduced; bf16/fp16
is autocast over fp32 weights). Beside tensor or pipeline parallelism: FSDP2's
`replicate` over the dp mesh, per block then the rest (gradients all-reduced; it
composes with DTensor parameters where DistributedDataParallel does not).
ZeRO-1's sharded optimizer is the optimizer's business (trainlab.optim)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from trainlab.train.parallel.blocks import blocks


def ddp(model: nn.Module, device: Any) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def ignore(model: nn.Module, names: list[str]) -> nn.Module:
    """`model`, with DDP told to leave the parameters `names` alone (neither
    broadcast nor all-reduced: expert parallelism syncs its own)."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return model


def apply(model: nn.Module, mesh: Any, ignored: set[nn.Parameter] | None = None) -> None:
    """FSDP2's replicate over `mesh`, per block then the rest, leaving the
    parameters `ignored` alone (expert parallelism's experts)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in blocks(model):
        replicate(block, mesh=mesh, ignored_params=ignored)
    replicate(model, mesh=mesh, ignored_params=ignored)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP (FSDP2 shards in place and needs no unwrapping)."""
    return model.module if hasattr(model, "module") else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """DDP: skip the gradient all-reduce on all but the last micro batch (the
    gradients accumulate unsharded either way). FSDP reduce-scatters after every
    micro batch, so only sharded gradients are ever kept: skipping it would hold
    every layer's full fp32 gradients through the accumulation, which is what
    ZeRO-2/3 exist to avoid; the price is one reduce-scatter per micro batch."""
    if enabled or not hasattr(model, "no_sync"):
        yield
    else:
        with model.no_sync():
            yield
