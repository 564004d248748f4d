"""`model.arch: MODULE:NAME`: an architecture from the user's own code.

MODULE is imported from `model.code_dir` (by default the folder of the config
file that names it, set by trainlab.config.loader) or else from the Python
path (a Ray job's working_dir is on it). NAME is either

- a plain callable `build(model_section) -> torch.nn.Module`, or
- a subclass of `trainlab.models.Architecture` whose `build(model_section)`
  makes the model and which may also declare `options_model` (a pydantic
  model checking `model.options`), `check(section)`, `isolates_documents(section)`,
  `experts(section)` and `export(model, out_dir)`.

The module is called as every trainlab model is:
`model(input_ids, position_ids=None, document_ids=None) -> logits [B, T, V]`.
Everything the planner needs is measured on a meta-device build
(trainlab.models.measured). No file of trainlab changes to add a model.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainlab.models.base import Architecture, ConfigIssue, ModelSpec
from trainlab.models.measured import MeasuredArchitecture, cross_document_issue

if TYPE_CHECKING:
    from torch import nn

_LOADED: dict[tuple[str, str | None], UserArchitecture] = {}


class UserArchitectureError(Exception):
    """Why MODULE:NAME does not name an architecture (one line)."""


def is_user_arch(name: str) -> bool:
    return ":" in name and not name.startswith("hf:")


def load(name: str, code_dir: str | None) -> UserArchitecture:
    """The architecture `name` (MODULE:NAME) names; UserArchitectureError says why not."""
    key = (name, code_dir)
    if key not in _LOADED:
        _LOADED[key] = _load(name, code_dir)
    return _LOADED[key]


def _load(name: str, code_dir: str | None) -> UserArchitecture:
    module_name, _, attr = name.partition(":")
    if code_dir and Path(code_dir).is_dir() and code_dir not in sys.path:
        sys.path.insert(0, code_dir)
    where = f"{code_dir} or the Python path" if code_dir else "the Python path"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise UserArchitectureError(f"no module {module_name!r} in {where}") from None
        raise UserArchitectureError(f"importing {module_name!r} failed: {err}") from None
    except Exception as err:  # the user's module raised while importing
        text = " ".join(f"{type(err).__name__}: {err}".split())
        raise UserArchitectureError(f"importing {module_name!r} failed: {text}") from None
    target = getattr(module, attr, None)
    if target is None:
        raise UserArchitectureError(f"module {module_name!r} ({module.__file__}) has no {attr!r}")
    if isinstance(target, type) and issubclass(target, Architecture):
        declared: Architecture | None = target()
        build = declared.build
    elif callable(target) and not isinstance(target, type):
        declared, build = None, target
    else:
        raise UserArchitectureError(
            f"{name} is neither a trainlab.models.Architecture subclass nor a function "
            "build(model_section) -> torch.nn.Module"
        )
    arch = UserArchitecture(build, declared)
    arch.name = name
    arch.source = getattr(module, "__file__", None)
    return arch


class UserArchitecture(MeasuredArchitecture):
    """A user's build function, or their `Architecture` subclass, with every
    planner fact measured."""

    def __init__(self, build: Callable[[Any], nn.Module], declared: Architecture | None):
        self._build = build
        self.declared = declared
        self.source: str | None = None
        summary = getattr(declared, "summary", "") if declared is not None else ""
        self.summary = summary or (build.__doc__ or "").strip().split("\n")[0]

    def build_module(self, m: ModelSpec) -> nn.Module:
        return self._build(m)

    def _declared(self, name: str) -> Any:
        """The user class's own override of `name`, or None."""
        if self.declared is None:
            return None
        own = getattr(type(self.declared), name, None)
        base = getattr(Architecture, name, None)
        return None if own is None or own is base else getattr(self.declared, name)

    def check(self, m: Mapping[str, Any]) -> Iterator[ConfigIssue]:
        options_model = getattr(self.declared, "options_model", None)
        if options_model is not None:
            from pydantic import ValidationError

            try:
                options_model.model_validate(m.get("options") or {})
            except ValidationError as err:
                for e in err.errors():
                    path = ".".join(str(p) for p in e["loc"])
                    yield ConfigIssue(f"model.options.{path}", e.get("input"), e["msg"])
        own = self._declared("check")
        if own is not None:
            yield from own(m)
        reason = self.isolates_documents(m)
        if reason and not m.get("cross_document_attention"):
            yield cross_document_issue(self.name, reason)

    def isolates_documents(self, m: Mapping[str, Any]) -> str | None:
        own = self._declared("isolates_documents")
        return own(m) if own is not None else None

    def default_ffn_hidden_size(self, m: ModelSpec) -> int:
        own = self._declared("default_ffn_hidden_size")
        return own(m) if own is not None else 4 * m.hidden_size

    def experts(self, m: ModelSpec) -> tuple[int, int] | None:
        own = self._declared("experts")
        return own(m) if own is not None else None

    def tensor_parallel_plan(self, m: Any) -> dict[str, str] | None:
        own = self._declared("tensor_parallel_plan")
        return own(m) if own is not None else None

    def export_refusal(self, m: ModelSpec) -> str | None:
        if self._declared("export") is not None:
            return None
        return (
            f"model.arch = {self.name!r}: a user architecture exports only if it says how "
            "(an Architecture subclass with export(model, out_dir))"
        )

    def export(self, model: nn.Module, out: Any) -> None:
        self.declared.export(model, out)
