"""Optimizers, chosen by name (`train.optimizer.name` in the config).

Adding an optimizer is a one-file change: put a module in this package with a
subclass of `trainlab.optim.base.OptimizerConfig` decorated with
`@register_optimizer`. Its class holds everything trainlab knows about the
optimizer: its config fields with bounds, `build()` (the torch optimizer over a
model part), the bytes of state and step temporaries the planner counts, and
what one checkpoint of it holds. Modules here are discovered the first time the
config schema is built, so nothing else needs editing; `train.optimizer: {name:
...}` then validates, plans, trains and checkpoints it.

Torch-free at import: modules here import torch only inside `build()` and the
functions it calls, so `trainlab validate/show/plan` never load it. Config-free
too: nothing here imports trainlab.config (the schema imports this registry).
"""

from __future__ import annotations

import importlib
import pkgutil

from trainlab.optim.base import OptimizerConfig, PlanParam, StepMemory

__all__ = [
    "OptimizerConfig",
    "PlanParam",
    "StepMemory",
    "optimizer_classes",
    "optimizer_names",
    "register_optimizer",
]

_REGISTRY: dict[str, type[OptimizerConfig]] = {}
_discovered = False


def register_optimizer(cls: type[OptimizerConfig]) -> type[OptimizerConfig]:
    """Class decorator: register an optimizer config under its `name` literal."""
    name = cls.model_fields["name"].default
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__}: `name` needs a string default (its Literal)")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"optimizer {name!r} registered twice")
    _REGISTRY[name] = cls
    return cls


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("base",) and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    _discovered = True


def optimizer_classes() -> list[type[OptimizerConfig]]:
    """Every registered optimizer's config class, the default (`adamw`) first."""
    _discover()
    return sorted(_REGISTRY.values(), key=lambda c: (c.model_fields["name"].default != "adamw",
                                                     c.model_fields["name"].default))


def optimizer_names() -> list[str]:
    return [c.model_fields["name"].default for c in optimizer_classes()]
