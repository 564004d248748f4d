"""Model architectures, chosen by name (`model.arch` in the config).

Adding an architecture is a one-file change: put a module in
`trainlab.models.archs` with a subclass of `Architecture` decorated with
`@register_arch("name")`. Modules there are discovered automatically the first
time a name is looked up, so nothing else needs editing; `model.arch: name`
then validates, plans and builds it.

An architecture holds everything trainlab knows about one model family: its
exact parameter count, its config checks and defaults, the facts the planner
needs, and `build()`, which composes the torch building blocks of
`trainlab.models.layers`.

Torch-free: this module and every module of `archs` import torch only inside
`build()`, so `trainlab validate/show/plan` never load it. Config-free too: the
config layer asks this registry for names, defaults and checks, so nothing in
trainlab.models imports trainlab.config (architectures read the model section
through the `ModelSpec` protocol and report `ConfigIssue`s).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from trainlab.errors import UserError
from trainlab.models.base import (
    Architecture,
    ConfigIssue,
    ModelSpec,
    ParamCount,
    ParamShape,
    StepDtypes,
    resolve_attention,
)

if TYPE_CHECKING:
    from torch import nn

ARCHS_PACKAGE = "trainlab.models.archs"

_REGISTRY: dict[str, Architecture] = {}
_discovered = False


def register_arch(name: str) -> Callable[[type[Architecture]], type[Architecture]]:
    """Make the decorated `Architecture` subclass selectable as `model.arch: name`."""

    def add(cls: type[Architecture]) -> type[Architecture]:
        existing = _REGISTRY.get(name)
        if existing is not None and _qualified(type(existing)) != _qualified(cls):
            raise ValueError(f"architecture {name!r} is registered twice")
        arch = cls()
        arch.name = name
        _REGISTRY[name] = arch
        return cls

    return add


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    package = importlib.import_module(ARCHS_PACKAGE)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{ARCHS_PACKAGE}.{module.name}")
    _discovered = True


def arch_names() -> list[str]:
    """Names of every architecture, sorted."""
    _discover()
    return sorted(_REGISTRY)


def find_arch(name: str, code_dir: str | None = None) -> Architecture | None:
    """The architecture `name` names, or None: a family registered under that
    name, `hf:MODEL_TYPE` (trainlab.models.hf) or `MODULE:NAME` imported from
    `code_dir` or the Python path (trainlab.models.user)."""
    if name.startswith("hf:"):
        from trainlab.models import hf

        return hf.find(name)
    if ":" in name:
        from trainlab.models import user

        try:
            return user.load(name, code_dir)
        except user.UserArchitectureError:
            return None
    _discover()
    return _REGISTRY.get(name)


def unknown_arch_message(name: str = "", code_dir: str | None = None) -> str:
    """Why `name` names no architecture (one line)."""
    if name.startswith("hf:"):
        from trainlab.models import hf

        return hf.unknown_type_message(hf.model_type_of(name))
    if ":" in name:
        from trainlab.models import user

        try:
            user.load(name, code_dir)
        except user.UserArchitectureError as err:
            return str(err)
    return (
        f"unknown architecture; available: {', '.join(arch_names())}, hf:MODEL_TYPE "
        "(a transformers family) or MODULE:NAME (your own, docs/models.md)"
    )


def attention_names() -> tuple[str, ...]:
    """The names `model.attention` may take: those of the `@register("name")`
    decorators in trainlab.models.attention's modules, read without importing them
    (they import torch; `trainlab validate` must not), and any registered at run
    time when that package is already loaded."""
    import sys

    names = set(_attention_files_names())
    loaded = sys.modules.get("trainlab.models.attention")
    if loaded is not None:
        names |= set(getattr(loaded, "_REGISTRY", {}))
    return tuple(sorted(names))


@functools.cache
def _attention_files_names() -> tuple[str, ...]:
    import ast
    from importlib.util import find_spec

    spec = find_spec("trainlab.models.attention")
    folders = list(spec.submodule_search_locations or []) if spec else []
    names: set[str] = set()
    for folder in folders:
        for path in sorted(Path(folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.FunctionDef):
                    continue
                for dec in node.decorator_list:
                    if (
                        isinstance(dec, ast.Call)
                        and getattr(dec.func, "id", None) == "register"
                        and dec.args
                        and isinstance(dec.args[0], ast.Constant)
                    ):
                        names.add(str(dec.args[0].value))
    return tuple(sorted(names))


def get_arch(name: str, code_dir: str | None = None) -> Architecture:
    """The architecture `name` names; a UserError says why none."""
    arch = find_arch(name, code_dir)
    if arch is None:
        raise UserError(f"model.arch = {name!r}: {unknown_arch_message(name, code_dir)}")
    return arch


def arch_of(m: ModelSpec) -> Architecture:
    """The architecture of a model section."""
    return get_arch(m.arch, getattr(m, "code_dir", None))


def build_model(m: ModelSpec) -> nn.Module:
    """The model described by the config's model section, initialized: called as
    `model(input_ids, position_ids=..., document_ids=...)`, it returns logits."""
    return arch_of(m).build(m)


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "Architecture",
    "ConfigIssue",
    "ModelSpec",
    "ParamCount",
    "ParamShape",
    "StepDtypes",
    "arch_names",
    "arch_of",
    "build_model",
    "find_arch",
    "get_arch",
    "num_parameters",
    "register_arch",
    "resolve_attention",
]
