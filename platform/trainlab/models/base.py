"""The types every architecture is made of: the model section it reads
(`ModelSpec`), the problems it reports (`ConfigIssue`), its parameter counts
and shapes, the dtypes of a step, and the `Architecture` base class.
Torch-free and config-free (trainlab.models.registry says why)."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from torch import nn

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
    options: dict[str, Any]
    code_dir: str | None
    cross_document_attention: bool
    # model.moe (trainlab.models.moe), None for a dense model; read with getattr
    # (a spec made elsewhere may not have it).
    moe: Any

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


@dataclass(frozen=True)
class ParamShape:
    """One parameter tensor of the built model, in `model.parameters()` order."""

    name: str
    shape: tuple[int, ...]
    layer: int | None  # index in `model.layers`; None: outside the blocks (FSDP's root)
    matmul: bool = False  # a Linear weight: autocast keeps a 16-bit copy of it

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StepDtypes:
    """Bytes per element of what one training step keeps, as the trainer runs it
    (trainlab.train.parallel; `trainlab.plan.memory.step_dtypes` derives it from
    the strategy, the precision and the device)."""

    compute: int  # matmul inputs and outputs: 2 under bf16/fp16, 4 in fp32
    residual: int  # the residual stream between blocks (4 under autocast: fp32 weights)
    autocast: bool  # 16-bit compute over fp32 weights: each consumer casts its own copy
    norm_fp32: bool  # layer_norm runs in fp32 (CUDA autocast's policy; not CPU's)
    grad: int  # a weight gradient as autograd makes it: 4, or 2 for 16-bit parameters
    cast_block_inputs: bool  # FSDP mixed precision casts each block's float inputs
    # The attention implementation the step runs (`model.attention` resolved for the
    # device: resolve_attention); "" reads `model.attention` as given.
    attention: str = ""


class Architecture:
    """One model family. Subclass it in a module of `trainlab.models.archs`, set the
    facts, implement `count_params` and `build`, and decorate it with
    `@register_arch("name")` (which sets `name` and registers one instance)."""

    name: str = ""
    # One line for humans (docs, error messages).
    summary: str = ""
    # Facts measured on the model (trainlab.models.measured) rather than stated here:
    # architectures brought by the user (hf:TYPE, MODULE:NAME).
    measured: bool = False
    # A pydantic model checking `model.options` (None: this family takes none).
    options_model: Any = None
    # Planner facts (Korthikanti et al. 2022 activation terms, see
    # trainlab.plan.model_math.activation_bytes_per_layer):
    # the MLP keeps 3 + mlp_activation_factor * ffn/hidden bytes per s*b*h
    # (4 for a GELU MLP: fc output and its GELU; 8 for SwiGLU: gate, its
    # activation, up, product).
    mlp_activation_factor: float = 4.0
    # A learned absolute position table (counted as ParamCount.position).
    learned_positions: bool = False
    # Trainer facts (what trainlab.models.layers allocates; the planner's memory
    # model, trainlab.plan.memory, checked against a trace of the real step):
    # the norm module: "rms" (trainlab RMSNorm, computed in fp32 inside) or
    # "layer" (nn.LayerNorm, weight and bias).
    norm: str = "rms"
    # Biases on the attention and MLP projections.
    bias: bool = False

    def attention_activation_terms(self, kv_ratio: float) -> float:
        """Bytes per s*b*h the attention block keeps besides the scores:
        7 + 4*g with g = kv_heads/heads (K and V shrink under GQA)."""
        return 7 + 4 * kv_ratio

    def default_ffn_hidden_size(self, m: ModelSpec) -> int:
        """The MLP width when `model.ffn_hidden_size` is null."""
        return 4 * m.hidden_size

    # ------------------------------------------------------------------ trainer facts
    # Per token, in bytes, for the dtypes `d` of the step. Derived from the modules of
    # trainlab.models.layers and what autograd saves for their backward; the derivation
    # of each term is in the method's docstring.

    @property
    def mlp_tensors(self) -> int:
        """Tensors of width ffn the MLP saves: 4 for SwiGLU (gate, its SiLU, up,
        product), 2 for a GELU MLP (fc output, its GELU): mlp_activation_factor/2."""
        return round(self.mlp_activation_factor / 2)

    @property
    def mlp_inputs(self) -> int:
        """Linears reading the MLP's input: 2 for SwiGLU (gate, up), 1 for GELU (fc).
        Under autocast each casts its own 16-bit copy of it."""
        return max(1, self.mlp_tensors // 2)

    def layer_extra_params(self, m: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
        """Parameters a block has besides norms, projections and MLP (none here)."""
        return []

    def moe_param_shapes(self, m: ModelSpec, prefix: str, layer: int) -> list[ParamShape] | None:
        """The parameters of block `layer`'s MoE layer (`prefix`.mlp.*), or None
        when that block has a dense MLP (always, for a family without MoE)."""
        return None

    def param_shapes(self, m: ModelSpec) -> list[ParamShape]:
        """Every parameter tensor `build(m)` creates, in `model.parameters()` order.
        Must add up to `count_params(m).total` (the planner checks)."""
        h, f, v = m.hidden_size, m.ffn_hidden_size, m.vocab_size
        kv = (m.num_kv_heads or m.num_heads) * (h // m.num_heads)

        def norm(name: str, layer: int | None) -> list[ParamShape]:
            out = [ParamShape(f"{name}.weight", (h,), layer)]
            if self.norm == "layer":
                out.append(ParamShape(f"{name}.bias", (h,), layer))
            return out

        def linear(name: str, rows: int, cols: int, layer: int) -> list[ParamShape]:
            out = [ParamShape(f"{name}.weight", (rows, cols), layer, matmul=True)]
            if self.bias:
                out.append(ParamShape(f"{name}.bias", (rows,), layer))
            return out

        shapes = [ParamShape("tok_embeddings.weight", (v, h), None)]
        if self.learned_positions:
            shapes.append(ParamShape("pos_embeddings.weight", (m.max_seq_len, h), None))
        for i in range(m.num_layers):
            pre = f"layers.{i}"
            shapes += norm(f"{pre}.attn_norm", i)
            shapes += linear(f"{pre}.attn.q", h, h, i)
            shapes += linear(f"{pre}.attn.k", kv, h, i) + linear(f"{pre}.attn.v", kv, h, i)
            shapes += linear(f"{pre}.attn.out", h, h, i)
            shapes += [ParamShape(f"{pre}.{n}", s, i) for n, s in self.layer_extra_params(m)]
            shapes += norm(f"{pre}.mlp_norm", i)
            moe = self.moe_param_shapes(m, pre, i)
            if moe is not None:
                shapes += moe
                continue
            if self.mlp_tensors >= 4:
                shapes += linear(f"{pre}.mlp.gate", f, h, i) + linear(f"{pre}.mlp.up", f, h, i)
            else:
                shapes += linear(f"{pre}.mlp.fc", f, h, i)
            shapes += linear(f"{pre}.mlp.proj", h, f, i)
        shapes += norm("norm", None)
        if not m.tie_embeddings:
            shapes.append(ParamShape("output.weight", (v, h), None, matmul=True))
        return shapes

    def norm_saved_bytes(self, m: ModelSpec, d: StepDtypes, consumers: int = 1) -> float:
        """What one norm keeps for backward, with `consumers` linears reading it.

        RMSNorm (x.float(), * rsqrt(mean(x^2) + eps), .to(x.dtype), * weight): the
        fp32 input (x itself when fp32, else its fp32 copy) for pow and the product,
        the normed tensor in x's dtype for the product with the weight, rsqrt (4),
        and the output the linears save: under autocast one 16-bit copy per
        consumer, else the output itself. LayerNorm: its input (an fp32 copy when
        CUDA autocast runs it in fp32), mean and rstd (8), the output as above."""
        h = m.hidden_size
        out = d.compute * h * (consumers if d.autocast else 1)
        if self.norm == "layer":
            kept_input = 4 if (d.norm_fp32 and d.residual < 4) else d.residual
            return kept_input * h + 8 + out
        return 4 * h + d.residual * h + 4 + out

    def attention_saved_bytes(self, m: ModelSpec, d: StepDtypes, seq_len: int) -> float:
        """What attention keeps besides its input norm: the q, k and v projections'
        outputs (the head views are not copies), q and k after RoPE (new tensors),
        the attention output (the out projection's input is a view of it), and the
        kernel's own: for `sdpa` the log-sum-exp (fp32, one per head) and the mask
        it was given (the packed batch's block-diagonal mask, converted to the
        compute dtype, [T] per token); for `flex` the log-sum-exp only (its block
        mask is per batch, a few bytes per pair of 128-token blocks: no [T, T]
        tensor); for `eager` the fp32 softmax and its 16-bit cast ([heads, T]
        each), the masked scores, and K/V repeated for grouped-query attention."""
        h, a = m.hidden_size, m.num_heads
        kv = (m.num_kv_heads or a) * (h // a)
        c = d.compute
        saved = c * (h + 2 * kv) + c * h
        if not self.learned_positions:  # RoPE: new q and k
            saved += c * (h + kv)
        impl = d.attention or m.attention
        if impl == "eager":
            repeat = 2 * c * h if kv != h else 0
            return saved + repeat + (4 + c) * a * seq_len + seq_len
        if impl == "flex":
            return saved + 4 * a
        return saved + 4 * a + c * seq_len

    def attention_kept_bytes(self, m: ModelSpec, d: StepDtypes) -> float:
        """What a block recomputed under `selective` keeps besides its inputs: the
        fused attention kernel's output and log-sum-exp (trainlab.train.parallel.
        recompute's save list); nothing for `eager` (no single kernel to keep)."""
        if (d.attention or m.attention) == "eager":
            return 0.0
        return d.compute * m.hidden_size + 4 * m.num_heads

    def mlp_saved_bytes(self, m: ModelSpec, d: StepDtypes) -> float:
        """The MLP's width-ffn tensors (mlp_tensors of them) in the compute dtype."""
        return self.mlp_tensors * d.compute * m.ffn_hidden_size

    def block_saved_bytes(self, m: ModelSpec, d: StepDtypes, seq_len: int) -> float:
        """What one block keeps for backward, per token (weights' 16-bit copies
        apart: see ParamShape.matmul): two norms, attention, MLP, the RoPE tables
        when cast per block, dropout masks (one byte per element on CUDA)."""
        saved = (
            self.norm_saved_bytes(m, d, 3)  # read by the q, k and v projections
            + self.attention_saved_bytes(m, d, seq_len)
            + self.norm_saved_bytes(m, d, self.mlp_inputs)
            + self.mlp_saved_bytes(m, d)
            + self.block_input_extra_bytes(m, d)
        )
        if m.dropout > 0:
            saved += 2 * m.hidden_size
        return saved

    def block_input_extra_bytes(self, m: ModelSpec, d: StepDtypes) -> float:
        """Inputs of a block besides the residual stream that it owns: the cos and
        sin of RoPE in the compute dtype when FSDP casts the block's inputs."""
        if self.learned_positions or not d.cast_block_inputs:
            return 0.0
        return 2 * d.compute * m.head_dim

    def block_input_bytes(self, m: ModelSpec, d: StepDtypes) -> float:
        """What a recomputed (checkpointed) block keeps: its inputs."""
        return d.residual * m.hidden_size + self.block_input_extra_bytes(m, d)

    def block_backward_bytes(self, m: ModelSpec, d: StepDtypes, tokens: int) -> float:
        """The backward of one block at its high-water mark, above what it had
        saved: in the MLP, the gradients of the ffn-wide tensors in flight
        (mlp_tensors/2 of them net of the saved ones already freed) and the
        gradient of the widest weight (ffn x hidden) in the dtype autograd makes
        it, less its 16-bit copy, freed once used under autocast."""
        h, f = m.hidden_size, m.ffn_hidden_size
        grads = self.mlp_inputs * d.compute * f * tokens
        weight = d.grad * h * f - (d.compute * h * f if d.autocast else 0)
        return grads + weight

    def check(self, m: Mapping[str, Any]) -> Iterator[ConfigIssue]:
        """Problems of the plain `model` section dict that only this architecture has
        (general rules, e.g. heads dividing hidden_size, are checked elsewhere)."""
        return iter(())

    def count_params(self, m: ModelSpec) -> ParamCount:
        """The exact parameter count of `build(m)`, without torch."""
        raise NotImplementedError

    def active_params(self, m: ModelSpec) -> int:
        """Parameters one token goes through (all, for a dense model)."""
        return self.count_params(m).total

    def measuring(self) -> contextlib.AbstractContextManager[None]:
        """What a measurement of this model (meta or fake tensors: the planner's,
        the memory trace's) runs under; nothing for most."""
        return contextlib.nullcontext()

    def tensor_parallel_plan(self, m: Any) -> dict[str, str] | None:
        """{module path pattern: "colwise" | "rowwise"} for an architecture whose
        tensor parallelism comes from a plan; trainlab's families shard by their
        own module names (trainlab.train.parallel.tensor)."""
        return None

    def isolates_documents(self, m: Mapping[str, Any]) -> str | None:
        """None when a packed document sees only itself (trainlab's families pass
        the document mask to every attention layer); else the reason it does not."""
        return None

    def build(self, m: ModelSpec) -> nn.Module:
        """The initialized model; import torch inside. The module must have `.layers`
        (an nn.ModuleList of blocks), `.tok_embeddings`, `.output` and
        `forward(input_ids, position_ids=None, document_ids=None) -> [B, T, V]`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<architecture {self.name!r}>"


def resolve_attention(name: str, cuda: bool, dropout: float = 0.0) -> str:
    """The implementation `model.attention = name` runs: `auto` is FlexAttention
    (block mask, no `[T, T]` tensor) on CUDA and SDPA elsewhere (FlexAttention
    has no backward on CPU) or with dropout (FlexAttention has none); any other
    name is itself. Torch-free: the planner asks it too."""
    if name != "auto":
        return name
    return "flex" if cuda and dropout == 0 else "sdpa"


__all__ = [
    "Architecture",
    "ConfigIssue",
    "ModelSpec",
    "ParamCount",
    "ParamShape",
    "StepDtypes",
    "resolve_attention",
]
