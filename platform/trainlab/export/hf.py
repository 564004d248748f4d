"""trainlab architectures as transformers classes: config.json, tensor names and
layouts, and what cannot be represented (refused, never exported wrong).

| model.arch     | transformers class | notes |
| -------------- | ------------------ | ----- |
| `llama`        | LlamaForCausalLM   | same names up to renaming; RoPE rotate-half (HF's convention) |
| `llama_qknorm` | Qwen3ForCausalLM   | per-head RMSNorm of q and k before RoPE, as Qwen3 does |
| `gpt2`         | GPT2LMHeadModel    | Conv1D weights are transposed; q, k, v fused into c_attn |
| `llama` + `model.moe` | MixtralForCausalLM | every layer MoE, softmax top-k renormalized; experts' gate and up fused into gate_up_proj |
| `llama_qknorm` + `model.moe` | Qwen3MoeForCausalLM | dense layers as mlp_only_layers; norm_topk_prob = normalize_top_k |

An MoE is written in transformers 5's expert layout (3-D `gate_up_proj` and
`down_proj` per layer); what those classes cannot represent (a sigmoid router,
shared experts, the aux-loss-free routing bias, a capacity that drops tokens) is
refused.

Attention implementations (`model.attention`) other than the standard causal
softmax attention (its kernels `auto`, `sdpa`, `flex`, `eager`) have no
transformers equivalent.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainlab.config.schema import ModelConfig
from trainlab.errors import UserError

# The kernels of standard causal softmax attention (trainlab.config.loader
# SAME_MATH_ATTENTION): transformers runs the same with its own.
STANDARD_ATTENTION = ("auto", "sdpa", "flex", "eager")
HF_CLASS = {"llama": "LlamaForCausalLM", "llama_qknorm": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel"}
MODEL_TYPE = {"llama": "llama", "llama_qknorm": "qwen3", "gpt2": "gpt2"}
MOE_CLASS = {"llama": "MixtralForCausalLM", "llama_qknorm": "Qwen3MoeForCausalLM"}
MOE_MODEL_TYPE = {"llama": "mixtral", "llama_qknorm": "qwen3_moe"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}

Build = Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the transformers checkpoint: built from trainlab tensors."""

    name: str
    sources: tuple[str, ...]
    build: Build


def _same(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0]


def _transposed(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0].t()


def _cat_rows(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, dim=0)


def _cat_rows_transposed(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, dim=0).t()


def _cat_experts(ts: list[torch.Tensor]) -> torch.Tensor:
    """[E, f, h] gate and up stacked as transformers' gate_up_proj [E, 2f, h]."""
    return torch.cat(ts, dim=1)


def hf_class(m: ModelConfig) -> str:
    """The transformers class of a trainlab family (an MoE's when model.moe is set)."""
    return MOE_CLASS[m.arch] if m.moe is not None else HF_CLASS[m.arch]


def _moe_refusals(m: ModelConfig) -> list[str]:
    moe = m.moe
    if moe is None or m.arch not in MOE_CLASS:
        return []
    cls, out = MOE_CLASS[m.arch], []
    if moe.router.score != "softmax":
        out.append(f"model.moe.router.score = {moe.router.score!r}: {cls} routes by softmax")
    if moe.shared_experts:
        out.append(f"model.moe.shared_experts = {moe.shared_experts}: {cls} has none")
    if moe.balance == "bias":
        out.append(
            f"model.moe.balance = 'bias': the routing bias changes which experts a token "
            f"gets; {cls} has no such bias"
        )
    if moe.capacity_factor is not None:
        out.append(
            f"model.moe.capacity_factor = {moe.capacity_factor}: the model drops tokens "
            f"past the capacity; {cls} is dropless"
        )
    if m.arch == "llama" and not moe.router.normalize_top_k:
        out.append(f"model.moe.router.normalize_top_k = False: {cls} always renormalizes")
    if m.arch == "llama" and (moe.first_dense_layers or moe.every_n_layers != 1):
        out.append(
            f"model.moe.first_dense_layers/every_n_layers: every layer of {cls} is MoE "
            "(llama_qknorm exports dense layers as Qwen3-MoE's mlp_only_layers)"
        )
    return out


def _qwen3_available() -> bool:
    """True unless an installed transformers lacks Qwen3 (added in 4.51)."""
    if importlib.util.find_spec("transformers") is None:
        return True  # nothing installed to contradict; config.json names qwen3
    return importlib.util.find_spec("transformers.models.qwen3") is not None


def refusals(m: ModelConfig) -> list[str]:
    """What in the model section transformers cannot represent (empty: exportable).
    An architecture brought by the user exports itself (hf:TYPE: its own class's
    save_pretrained) or says it cannot."""
    from trainlab.models.registry import find_arch

    arch = find_arch(m.arch, m.code_dir)
    if arch is not None and arch.measured:
        refusal = arch.export_refusal(m)
        return [refusal] if refusal else []
    out = []
    if m.arch not in HF_CLASS:
        out.append(
            f"model.arch = {m.arch!r}: no transformers class represents this architecture; "
            f"export supports {', '.join(sorted(HF_CLASS))}"
        )
    if m.attention not in STANDARD_ATTENTION:
        out.append(
            f"model.attention = {m.attention!r}: transformers has no equivalent of this "
            f"attention variant; export supports {', '.join(STANDARD_ATTENTION)}"
        )
    out += _moe_refusals(m)
    if m.arch == "llama_qknorm" and not _qwen3_available():
        out.append(
            "model.arch = 'llama_qknorm': its per-head q/k RMSNorm needs Qwen3ForCausalLM, "
            "which the installed transformers lacks (needs >= 4.51)"
        )
    return out


def check_exportable(m: ModelConfig) -> None:
    problems = refusals(m)
    if problems:
        raise UserError(problems)


# --------------------------------------------------------------------------- config.json


def hf_config(m: ModelConfig, eos_id: int, dtype: str) -> dict[str, Any]:
    """config.json of the transformers class for `m` (readable by transformers 4.x and 5.x)."""
    moe = m.moe
    common = {
        "architectures": [hf_class(m)],
        "model_type": MOE_MODEL_TYPE[m.arch] if moe is not None else MODEL_TYPE[m.arch],
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std,
        "bos_token_id": eos_id,  # documents end with EOS and start after one
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,  # padding is the EOS id (docs/contracts.md, section 3)
        "torch_dtype": DTYPE_NAMES[dtype],
        "use_cache": True,
    }
    if m.arch == "gpt2":
        return {
            **common,
            "n_positions": m.max_seq_len,
            "n_embd": m.hidden_size,
            "n_layer": m.num_layers,
            "n_head": m.num_heads,
            "n_inner": m.ffn_hidden_size,
            "activation_function": "gelu_pytorch_tanh",
            "layer_norm_epsilon": m.norm_eps,
            "resid_pdrop": m.dropout,
            "embd_pdrop": m.dropout,
            "attn_pdrop": m.dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }
    config = {
        **common,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads or m.num_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        # transformers 4.x reads rope_theta, 5.x rope_parameters
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "attention_bias": False,
        "attention_dropout": m.dropout,
    }
    if m.arch == "llama":
        config["mlp_bias"] = False
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.num_layers)
    if moe is not None:
        config.update(_moe_config(m))
    return config


def _moe_config(m: ModelConfig) -> dict[str, Any]:
    from trainlab.models.moe import expert_width, is_moe_layer

    moe = m.moe
    width = expert_width(moe, m.ffn_hidden_size)
    common = {"num_experts_per_tok": moe.top_k, "output_router_logits": False,
              "router_aux_loss_coef": moe.aux_loss_coef}  # fmt: skip
    if m.arch == "llama":  # Mixtral: every layer MoE, experts of intermediate_size
        return {**common, "num_local_experts": moe.num_experts, "intermediate_size": width,
                "sliding_window": None, "router_jitter_noise": 0.0}  # fmt: skip
    dense = [i for i in range(m.num_layers) if not is_moe_layer(moe, i)]
    return {**common, "num_experts": moe.num_experts, "moe_intermediate_size": width,
            "norm_topk_prob": moe.router.normalize_top_k, "decoder_sparse_step": 1,
            "mlp_only_layers": dense}  # fmt: skip


def generation_config(eos_id: int) -> dict[str, Any]:
    return {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}


# --------------------------------------------------------------------------- tensors


def _llama_tensors(m: ModelConfig) -> Iterator[HFTensor]:
    yield HFTensor("model.embed_tokens.weight", ("tok_embeddings.weight",), _same)
    renames = {
        "attn_norm": "input_layernorm",
        "attn.q": "self_attn.q_proj",
        "attn.k": "self_attn.k_proj",
        "attn.v": "self_attn.v_proj",
        "attn.out": "self_attn.o_proj",
        "mlp_norm": "post_attention_layernorm",
        "mlp.gate": "mlp.gate_proj",
        "mlp.up": "mlp.up_proj",
        "mlp.proj": "mlp.down_proj",
    }
    if m.arch == "llama_qknorm":
        renames |= {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
    from trainlab.models.moe import is_moe_layer

    mlp = ("mlp.gate", "mlp.up", "mlp.proj")
    for i in range(m.num_layers):
        moe = is_moe_layer(m.moe, i)
        for ours, theirs in renames.items():
            if moe and ours in mlp:
                continue
            yield HFTensor(f"model.layers.{i}.{theirs}.weight", (f"layers.{i}.{ours}.weight",), _same)
        if moe:
            ours, theirs = f"layers.{i}.mlp", f"model.layers.{i}.mlp"
            yield HFTensor(f"{theirs}.gate.weight", (f"{ours}.router.gate.weight",), _same)
            yield HFTensor(
                f"{theirs}.experts.gate_up_proj",
                (f"{ours}.experts.gate", f"{ours}.experts.up"),
                _cat_experts,
            )
            yield HFTensor(f"{theirs}.experts.down_proj", (f"{ours}.experts.down",), _same)
    yield HFTensor("model.norm.weight", ("norm.weight",), _same)
    if not m.tie_embeddings:
        yield HFTensor("lm_head.weight", ("output.weight",), _same)


def _gpt2_tensors(m: ModelConfig) -> Iterator[HFTensor]:
    yield HFTensor("transformer.wte.weight", ("tok_embeddings.weight",), _same)
    yield HFTensor("transformer.wpe.weight", ("pos_embeddings.weight",), _same)
    for i in range(m.num_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        for norm, ln in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            for p in ("weight", "bias"):
                yield HFTensor(f"{theirs}.{ln}.{p}", (f"{ours}.{norm}.{p}",), _same)
        qkv = tuple(f"{ours}.attn.{x}" for x in "qkv")
        yield HFTensor(
            f"{theirs}.attn.c_attn.weight", tuple(f"{s}.weight" for s in qkv), _cat_rows_transposed
        )
        yield HFTensor(f"{theirs}.attn.c_attn.bias", tuple(f"{s}.bias" for s in qkv), _cat_rows)
        # Conv1D keeps weights as [in, out]: the transpose of nn.Linear's.
        for src, dst in (("attn.out", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            yield HFTensor(f"{theirs}.{dst}.weight", (f"{ours}.{src}.weight",), _transposed)
            yield HFTensor(f"{theirs}.{dst}.bias", (f"{ours}.{src}.bias",), _same)
    yield HFTensor("transformer.ln_f.weight", ("norm.weight",), _same)
    yield HFTensor("transformer.ln_f.bias", ("norm.bias",), _same)
    if not m.tie_embeddings:
        yield HFTensor("lm_head.weight", ("output.weight",), _same)


def hf_tensors(m: ModelConfig, available: dict[str, tuple[int, ...]]) -> list[HFTensor]:
    """The transformers tensors of `m`, in checkpoint order, from the checkpoint's
    tensors `available` (name -> shape). Each must have the shape the model
    section gives, and every one must be used (a tied output projection is the
    embedding): one left over means the model has something this mapping does
    not know, and the export is refused rather than silently dropping it."""
    from trainlab.models.registry import arch_of

    for p in arch_of(m).param_shapes(m):
        shape = available.get(p.name)
        if shape is not None and tuple(shape) != p.shape:
            raise UserError(
                f"checkpoint tensor {p.name!r} has shape {list(shape)}, but the run's model "
                f"section gives {list(p.shape)}: config.yaml does not describe this checkpoint"
            )
    plan = list(_gpt2_tensors(m) if m.arch == "gpt2" else _llama_tensors(m))
    needed = {s for t in plan for s in t.sources}
    missing = sorted(needed - set(available))
    if missing:
        raise UserError(
            f"checkpoint lacks {len(missing)} tensor(s) model.arch {m.arch!r} has, "
            f"e.g. {missing[0]!r}: it was written by another model layout (an older "
            "trainlab, or another config)"
        )
    extra = sorted(set(available) - needed - ({"output.weight"} if m.tie_embeddings else set()))
    if extra:
        raise UserError(
            f"model.arch = {m.arch!r}: checkpoint tensor {extra[0]!r} (and {len(extra) - 1} "
            f"more) has no place in {hf_class(m)}; not exporting"
        )
    return plan
