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

import importlib
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from trainlab.errors import UserError

if TYPE_CHECKING:
    from torch import nn

ARCHS_PACKAGE = "trainlab.models.archs"

_REGISTRY: dict[str, Architecture] = {}
_discovered = False


class ModelSpec(Protocol):
    """What an architecture reads of the config's model section
    (trainlab.config.schema.ModelConfig; trainlab.models does not import the
    config layer, which asks this registry for names, defaults and checks)."""

    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None
    ffn_hidden_size: int | None
    vocab_size: int
    max_seq_len: int
    tie_embeddings: bool
    attention: str
    norm_eps: float
    rope_theta: float
    init_std: float
    dropout: float

    @property
    def head_dim(self) -> int: ...


class ConfigIssue(NamedTuple):
    """A problem an architecture finds in the model section; the config layer
    reports it as `{path} = {value!r}: {rule}`."""

    path: str
    value: Any
    rule: str


@dataclass(frozen=True)
class ParamCount:
    embedding: int  # token embedding table
    position: int  # learned position table (0 without learned positions)
    per_layer: int  # one transformer block
    layers: int  # all blocks
    final_norm: int
    head: int  # output projection when untied (0 when tied to the embedding)
    total: int

    @classmethod
    def of(cls, m: ModelSpec, *, per_layer: int, final_norm: int, position: int = 0) -> ParamCount:
        """The count of a decoder LM with `per_layer` parameters per block: adds the
        token embedding, the position table given, the final norm and, when
        untied, the output projection (vocab_size x hidden_size each)."""
        embedding = m.vocab_size * m.hidden_size
        head = 0 if m.tie_embeddings else m.vocab_size * m.hidden_size
        layers = per_layer * m.num_layers
        total = embedding + position + layers + final_norm + head
        return cls(embedding, position, per_layer, layers, final_norm, head, total)

    @property
    def non_embedding(self) -> int:
        """Parameters outside the lookup tables (blocks, final norm, untied head)."""
        return self.total - self.embedding - self.position

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Architecture:
    """One model family. Subclass it in a module of `trainlab.models.archs`, set the
    facts, implement `count_params` and `build`, and decorate it with
    `@register_arch("name")` (which sets `name` and registers one instance)."""

    name: str = ""
    # One line for humans (docs, error messages).
    summary: str = ""
    # Planner facts (Korthikanti et al. 2022 activation terms, see
    # trainlab.plan.model_math.activation_bytes_per_layer):
    # the MLP keeps 3 + mlp_activation_factor * ffn/hidden bytes per s*b*h
    # (4 for a GELU MLP: fc output and its GELU; 8 for SwiGLU: gate, its
    # activation, up, product).
    mlp_activation_factor: float = 4.0
    # A learned absolute position table (counted as ParamCount.position).
    learned_positions: bool = False

    def attention_activation_terms(self, kv_ratio: float) -> float:
        """Bytes per s*b*h the attention block keeps besides the scores:
        7 + 4*g with g = kv_heads/heads (K and V shrink under GQA)."""
        return 7 + 4 * kv_ratio

    def default_ffn_hidden_size(self, m: ModelSpec) -> int:
        """The MLP width when `model.ffn_hidden_size` is null."""
        return 4 * m.hidden_size

    def check(self, m: Mapping[str, Any]) -> Iterator[ConfigIssue]:
        """Problems of the plain `model` section dict that only this architecture has
        (general rules, e.g. heads dividing hidden_size, are checked elsewhere)."""
        return iter(())

    def count_params(self, m: ModelSpec) -> ParamCount:
        """The exact parameter count of `build(m)`, without torch."""
        raise NotImplementedError

    def build(self, m: ModelSpec) -> nn.Module:
        """The initialized model; import torch inside. The module must have `.layers`
        (an nn.ModuleList of blocks), `.tok_embeddings`, `.output` and
        `forward(input_ids, position_ids=None, document_ids=None) -> [B, T, V]`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<architecture {self.name!r}>"


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


def find_arch(name: str) -> Architecture | None:
    """The architecture registered as `name`, or None."""
    _discover()
    return _REGISTRY.get(name)


def unknown_arch_message() -> str:
    return f"unknown architecture; available: {', '.join(arch_names())}"


def get_arch(name: str) -> Architecture:
    """The architecture registered as `name`; a UserError names the choices."""
    arch = find_arch(name)
    if arch is None:
        raise UserError(f"model.arch = {name!r}: {unknown_arch_message()}")
    return arch


def build_model(m: ModelSpec) -> nn.Module:
    """The model described by the config's model section, initialized."""
    return get_arch(m.arch).build(m)


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "Architecture",
    "ConfigIssue",
    "ModelSpec",
    "ParamCount",
    "arch_names",
    "build_model",
    "find_arch",
    "get_arch",
    "num_parameters",
    "register_arch",
]
