"""Architectures whose planner facts are measured on the model itself.

A built-in family (trainlab.models.archs) states its parameter shapes and
activation terms by formula. An architecture brought by its user (`hf:TYPE`,
trainlab.models.hf; `MODULE:NAME`, trainlab.models.user) states none: a
`MeasuredArchitecture` builds the model on the meta device (no memory, no
random draws) and reads off

- every parameter tensor, its block (the repeated blocks: `repeated_blocks`)
  and whether it is a Linear weight: exact parameter counts, and the shapes
  the planner's memory model shards (trainlab.plan.memory);
- the FLOPs of one forward and backward, counted by torch's FlopCounterMode on
  meta tensors (an MoE's experts by their active share);
- what autograd saves per block and token (`saved_bytes_per_token`), under the
  step's dtypes: the activation term of the memory model.

Importing this module does not import torch (the config layer asks it for
names and checks); measuring does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainlab.models.base import (
    Architecture,
    ConfigIssue,
    ModelSpec,
    ParamCount,
    ParamShape,
    StepDtypes,
)

if TYPE_CHECKING:
    from torch import nn

# The tensor-parallel styles of an architecture's plan trainlab applies.
TP_STYLES = frozenset({"colwise", "rowwise"})

__all__ = ["Measurement", "MeasuredArchitecture", "repeated_blocks", "spec_key"]


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, what FSDP, recomputation and compile wrap one
    by one: the elements of `model.layers` (trainlab's own models and their
    pipeline stages); else the modules whose class the model names in
    `_no_split_modules` (transformers' convention, which a user model may follow);
    else the elements of the largest `nn.ModuleList` whose elements share one
    class. Empty when the model has none."""
    from torch import nn

    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    names = set(_no_split_names(model))
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if found:
            return found
    best: list[nn.Module] = []
    for module in model.modules():
        repeated = isinstance(module, nn.ModuleList) and len({type(m) for m in module}) == 1
        if repeated and len(module) > len(best):
            best = list(module)
    return best


def _no_split_names(model: nn.Module) -> list[str]:
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return list(names)
    return []


def spec_key(m: ModelSpec) -> str:
    """A cache key of the model section (a pydantic model or a plain spec)."""
    dump = getattr(m, "model_dump_json", None)
    return dump() if dump is not None else repr(sorted(vars(m).items()))


@dataclass(frozen=True)
class Measurement:
    """What a meta-device build of the model shows."""

    shapes: tuple[ParamShape, ...]
    count: ParamCount
    expert_params: int  # parameters of routed experts (0 for a dense model)
    num_blocks: int


def cross_document_issue(arch: str, reason: str) -> ConfigIssue:
    """The refusal of an architecture that cannot keep packed documents apart."""
    return ConfigIssue(
        "model.arch", arch,
        f"{reason}, so packed documents would see each other; set "
        "model.cross_document_attention: true to accept that for this run",
    )  # fmt: skip


class MeasuredArchitecture(Architecture):
    """An architecture known only by its `build`: counts, shapes, FLOPs and the
    activation term are measured (see the module docstring). Subclasses give
    `build_module(m)` and may state what the model supports."""

    measured = True

    # ------------------------------------------------------------------ to state
    def build_module(self, m: ModelSpec) -> nn.Module:
        """The model, on the current default device (meta when measuring)."""
        raise NotImplementedError

    def isolates_documents(self, m: Mapping[str, Any]) -> str | None:
        """None when a packed document sees only itself; else the reason it does not."""
        return None

    def tensor_parallel_plan(self, m: ModelSpec) -> dict[str, str] | None:
        """{module path pattern (from the model's root, `*` for any block): "colwise"
        | "rowwise"} when the model has a plan (Megatron-style: column-wise
        projections into attention and the MLP, row-wise out of them)."""
        return None

    def tensor_parallel_refusal(self, m: Any) -> str | None:
        """None when tensor parallelism can be applied from the model's plan; else why
        not. The styles trainlab applies are plain column- and row-wise shards, with
        every other parameter replicated (its gradient is then the same on every
        rank of the group, as in trainlab's own families without sequence
        parallelism)."""
        plan = self.tensor_parallel_plan(m)
        if not plan:
            return f"{self.name} has no tensor-parallel plan"
        other = sorted({s for s in plan.values() if s not in TP_STYLES})
        if other:
            return (
                f"{self.name}'s tensor-parallel plan uses {', '.join(other)}, which trainlab "
                f"does not apply (it applies {', '.join(sorted(TP_STYLES))}); use FSDP"
            )
        return None

    def pipeline_refusal(self, m: Mapping[str, Any]) -> str:
        return (
            f"architecture {self.name} declares no pipeline split (trainlab cuts its own "
            "families only)"
        )

    def experts(self, m: ModelSpec) -> tuple[int, int] | None:
        """(routed experts, experts per token) of an MoE; None for a dense model."""
        return None

    def export_refusal(self, m: ModelSpec) -> str | None:
        return f"model.arch = {self.name!r}: this architecture does not say how to export it"

    # ------------------------------------------------------------------ derived
    def build(self, m: ModelSpec) -> nn.Module:
        return self.build_module(m)

    def default_ffn_hidden_size(self, m: ModelSpec) -> int:
        return 4 * m.hidden_size

    def measure(self, m: ModelSpec) -> Measurement:
        return _measure(self, spec_key(m), m)

    def count_params(self, m: ModelSpec) -> ParamCount:
        return self.measure(m).count

    def param_shapes(self, m: ModelSpec) -> list[ParamShape]:
        return list(self.measure(m).shapes)

    def active_params(self, m: ModelSpec) -> int:
        """Parameters one token goes through: all but the routed experts it skips."""
        got = self.measure(m)
        ex = self.experts(m)
        if not ex or not got.expert_params:
            return got.count.total
        total, per_token = ex
        return got.count.total - round(got.expert_params * (1 - per_token / total))

    def flops_per_token(self, m: ModelSpec, seq_len: int) -> float:
        return _flops(self, spec_key(m), m, seq_len)

    def block_saved_bytes(self, m: ModelSpec, d: StepDtypes, seq_len: int) -> float:
        return _saved_bytes(self, spec_key(m), m, d, seq_len)

    def check(self, m: Mapping[str, Any]) -> Iterator[ConfigIssue]:
        return iter(())


# ----------------------------------------------------------------------- measuring

# The planner asks about one model many times; each measurement is made once.
_CACHE: dict[tuple[Any, ...], Any] = {}


def _cached(key: tuple[Any, ...], compute: Any) -> Any:
    if key not in _CACHE:
        if len(_CACHE) > 256:
            _CACHE.clear()
        _CACHE[key] = compute()
    return _CACHE[key]



def _meta_build(arch: MeasuredArchitecture, m: ModelSpec) -> nn.Module:
    import torch

    with torch.device("meta"):
        return arch.build_module(m)


def _measure_now(arch: MeasuredArchitecture, m: Any) -> Measurement:
    from torch import nn

    model = _meta_build(arch, m)
    blocks = repeated_blocks(model)
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            owner.setdefault(id(p), i)
    linear = {id(mod.weight) for mod in model.modules() if isinstance(mod, nn.Linear)}
    embedding_ids = {id(mod.weight) for mod in model.modules() if isinstance(mod, nn.Embedding)}
    expert_ids = {
        id(p)
        for name, mod in model.named_modules()
        if name.rsplit(".", 1)[-1] == "experts"
        for p in mod.parameters()
    }
    shapes, seen = [], set()
    embedding = head = rest = layers = experts = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        layer = owner.get(id(p))
        # A table tied to the output is the embedding's (the planner adds its copy).
        matmul = id(p) in linear and id(p) not in embedding_ids
        shapes.append(ParamShape(name, tuple(p.shape), layer, matmul=matmul))
        n = p.numel()
        experts += n if id(p) in expert_ids else 0
        if layer is not None:
            layers += n
        elif id(p) in embedding_ids:
            embedding += n
        elif id(p) in linear and p.shape[0] == m.vocab_size:
            head += n
        else:
            rest += n
    total = embedding + head + rest + layers
    per_layer = layers // max(1, len(blocks))
    count = ParamCount(embedding, 0, per_layer, layers, rest, head, total)
    return Measurement(tuple(shapes), count, experts, len(blocks))


def _measure(arch: MeasuredArchitecture, key: str, m: ModelSpec) -> Measurement:
    return _cached(("measure", arch.name, key), lambda: _measure_now(arch, m))


def _flops_now(arch: MeasuredArchitecture, m: Any, seq_len: int) -> float:
    """Forward and backward FLOPs of one row of `seq_len` tokens, per token. The
    routed experts' matmuls, which a meta tensor cannot route, are counted as
    6 FLOPs per active expert parameter (every token runs top-k of them)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model = _meta_build(arch, m)
    model.train()
    ids = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
    docs = torch.zeros((1, seq_len), dtype=torch.int32, device="meta")
    pos = torch.arange(seq_len, device="meta")[None]
    counter = FlopCounterMode(display=False)
    with counter, arch.measuring():
        logits = model(ids, position_ids=pos, document_ids=docs)
        logits.float().sum().backward()
    flops = float(counter.get_total_flops()) / seq_len
    ex = arch.experts(m)
    got = arch.measure(m)
    if ex and got.expert_params:
        total, per_token = ex
        flops += 6 * got.expert_params * per_token / total
    return flops


def _flops(arch: MeasuredArchitecture, key: str, m: ModelSpec, seq_len: int) -> float:
    return _cached(("flops", arch.name, key, seq_len), lambda: _flops_now(arch, m, seq_len))


def _saved_now(arch: MeasuredArchitecture, m: Any, d: StepDtypes, seq_len: int) -> float:
    """Bytes autograd keeps for backward per block and token: a forward of one
    packed row on fake CPU tensors (autocast applies to them, as it does not to
    meta ones), in the step's dtypes (16-bit parameters and inputs under FSDP's
    mixed precision, autocast over fp32 weights otherwise). Counted: every
    distinct storage saved while a block runs and by no other block; not
    counted: parameters and their 16-bit casts (the planner counts those with
    the parameters) and what every block shares (the document mask, RoPE's
    tables: model-level terms of the planner). The largest block's figure."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    compute = torch.float32 if d.compute == 4 else torch.bfloat16
    blocks_of: dict[int, set[int]] = {}
    nbytes: dict[int, int] = {}
    with FakeTensorMode(), arch.measuring():
        model = arch.build_module(m)
        model.train()
        if d.cast_block_inputs and d.compute == 2:  # FSDP's 16-bit gathered parameters
            for p in model.parameters():
                p.data = p.data.to(compute)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        param_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() >= 2}
        blocks = repeated_blocks(model)
        current: list[int] = []

        def enter(i: int):  # noqa: ANN202
            return lambda *_: current.append(i)

        def leave(*_: Any) -> None:  # a forward hook's return value replaces the output
            current.pop()

        handles = []
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(enter(i)))
            handles.append(block.register_forward_hook(leave))

        def pack(t: torch.Tensor) -> torch.Tensor:
            if current:
                storage = t.untyped_storage()
                sid = storage._cdata
                cast = d.autocast and t.dtype != torch.float32 and tuple(t.shape) in param_shapes
                if sid not in params and not cast:
                    blocks_of.setdefault(sid, set()).add(current[-1])
                    nbytes[sid] = storage.nbytes()
            return t

        ids = torch.zeros((1, seq_len), dtype=torch.long)
        docs = torch.zeros((1, seq_len), dtype=torch.int32)
        pos = torch.arange(seq_len)[None]
        autocast = torch.autocast("cpu", dtype=compute, enabled=d.autocast)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        try:
            with hooks, autocast:
                model(ids, position_ids=pos, document_ids=docs)
        finally:
            for h in handles:
                h.remove()
    per_block: dict[int, int] = {}
    for sid, owners in blocks_of.items():
        if len(owners) == 1:
            (block,) = owners
            per_block[block] = per_block.get(block, 0) + nbytes[sid]
    return max(per_block.values(), default=0) / seq_len


def _saved_bytes(
    arch: MeasuredArchitecture, key: str, m: ModelSpec, d: StepDtypes, seq_len: int
) -> float:
    return _cached(("saved", arch.name, key, d, seq_len), lambda: _saved_now(arch, m, d, seq_len))
