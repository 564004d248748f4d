"""`model.arch: hf:MODEL_TYPE`: any causal-LM family of transformers, built from
scratch (its config class, never a hub download) under trainlab's forward
contract.

The model section's common fields map onto the family's config class
(`COMMON_FIELDS`; the family's own names for them, e.g. gpt2's `n_embd`, are
found through its `attribute_map`); every other field of that class goes in
`model.options`, checked by the class itself at validate. The model is
`HFCausalLM`: `model(input_ids, position_ids=..., document_ids=...)` returns
logits, and a packed document sees only itself (positions reset per document,
a block-causal document mask, per layer type where the family mixes full and
sliding-window attention). A family with layers that carry state along the row
(linear attention, state-space, recurrent or convolutional mixers) cannot
isolate documents that way and is refused unless
`model.cross_document_attention: true` accepts it for the run.

Tensor parallelism comes from the family's `base_model_tp_plan` where it uses
only column- and row-wise shards (trainlab.train.parallel.tensor.apply_plan);
pipeline parallelism needs a declared split (docs/models.md).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from trainlab.models.base import ConfigIssue, ModelSpec
from trainlab.models.measured import MeasuredArchitecture, cross_document_issue

if TYPE_CHECKING:
    import torch
    from torch import nn

PREFIX = "hf:"

# The model section's fields -> the standard transformers config names.
COMMON_FIELDS = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "max_seq_len": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
    "init_std": "initializer_range",
}
# The MLP width, under the names families give it (an MoE's experts too).
FFN_FIELDS = ("intermediate_size", "n_inner", "ffn_dim", "d_ff")
EXPERT_FFN_FIELDS = ("moe_intermediate_size", "expert_intermediate_size")
NORM_EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
# Layer types a document mask isolates; any other carries state along the row.
MASKED_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Classes in a family's modeling file that mix tokens without attention.
STATEFUL_MIXERS = re.compile(r"Mamba|RWKV|GatedDeltaNet|LinearAttention|ShortConv|Recurrent|SSM")
ATTENTION_IMPLEMENTATIONS = {"sdpa": "sdpa", "eager": "eager", "flex": "flex_attention"}


def model_type_of(arch: str) -> str:
    return arch.removeprefix(PREFIX)


@functools.cache
def causal_lm_types() -> tuple[str, ...]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def unknown_type_message(model_type: str) -> str:
    close = difflib.get_close_matches(model_type, causal_lm_types(), n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(PREFIX + c for c in close)}? " if close else ""
    return (
        f"transformers {_version()} has no causal-LM family {model_type!r}; {hint}"
        f"{len(causal_lm_types())} are available (transformers' model_type names)"
    )


def _version() -> str:
    import transformers

    return transformers.__version__


def find(arch: str) -> HFArchitecture | None:
    model_type = model_type_of(arch)
    if model_type not in causal_lm_types():
        return None
    return _instance(model_type)


@functools.cache
def _instance(model_type: str) -> HFArchitecture:
    arch = HFArchitecture(model_type)
    arch.name = PREFIX + model_type
    return arch


class HFArchitecture(MeasuredArchitecture):
    """One transformers family (see the module docstring)."""

    def __init__(self, model_type: str):
        self.model_type = model_type
        self.summary = f"transformers' {model_type} (from scratch)"

    # ------------------------------------------------------------------ the config class
    @functools.cached_property
    def config_class(self) -> type:
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[self.model_type]

    @functools.cached_property
    def defaults(self) -> dict[str, Any]:
        """The config class's defaults."""
        return self.config_class().to_dict()

    @functools.cached_property
    def fields(self) -> set[str]:
        """The config class's own fields (its defaults' keys)."""
        return set(self.defaults) - {"transformers_version", "_name_or_path"}

    def _aliases(self) -> dict[str, str]:
        """Family name -> standard name (gpt2: n_embd -> hidden_size)."""
        return {v: k for k, v in getattr(self.config_class, "attribute_map", {}).items()}

    def _has(self, name: str) -> bool:
        return name in self.fields or name in getattr(self.config_class, "attribute_map", {})

    def config_kwargs(self, m: Mapping[str, Any]) -> dict[str, Any]:
        """The family's config: the common fields under its names, then the options."""
        options = dict(m.get("options") or {})
        kw: dict[str, Any] = {}
        for ours, theirs in COMMON_FIELDS.items():
            if self._has(theirs) and m.get(ours) is not None:
                kw[theirs] = m[ours]
        if "num_key_value_heads" in kw and m.get("num_kv_heads") is None:
            kw["num_key_value_heads"] = m["num_heads"]
        ffn = m.get("ffn_hidden_size")
        if ffn is not None:  # the MLP's width under the family's first name for it,
            mlp = next((n for n in FFN_FIELDS if self._has(n)), None)  # and the experts'
            for name in (mlp, *EXPERT_FFN_FIELDS):
                if name and self._has(name):
                    kw[name] = ffn
        if "head_dim" in self.fields:
            kw["head_dim"] = m["hidden_size"] // m["num_heads"]
        for name in NORM_EPS_FIELDS:
            if name in self.fields:
                kw[name] = m["norm_eps"]
        if "rope_parameters" in self.fields:
            defaults = self.defaults.get("rope_parameters") or {}
            if isinstance(defaults, dict) and "rope_theta" in defaults:
                kw["rope_parameters"] = {**defaults, "rope_theta": m["rope_theta"]}
        elif "rope_theta" in self.fields:
            kw["rope_theta"] = m["rope_theta"]
        # Special tokens: the dataset's tokenizer decides; a family's default id past
        # the vocabulary would only warn.
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if name in self.fields:
                kw[name] = None
        kw["use_cache"] = False
        kw.update(options)
        return kw

    def hf_config(self, m: Mapping[str, Any] | ModelSpec) -> Any:
        section = m if isinstance(m, Mapping) else _as_mapping(m)
        return self.config_class(**self.config_kwargs(section))

    # ------------------------------------------------------------------ validate
    def check(self, m: Mapping[str, Any]) -> Iterator[ConfigIssue]:
        options = m.get("options") or {}
        aliases = self._aliases()
        by_theirs = {v: k for k, v in COMMON_FIELDS.items()}
        bad = False
        for key in options:
            standard = aliases.get(key, key)
            if standard in by_theirs:
                bad = True
                yield ConfigIssue(
                    f"model.options.{key}", options[key],
                    f"is model.{by_theirs[standard]} for {self.name}: set that instead",
                )  # fmt: skip
            elif not self._has(key):
                bad = True
                close = difflib.get_close_matches(key, sorted(self.fields), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                yield ConfigIssue(
                    f"model.options.{key}", options[key],
                    f"not a field of transformers' {self.config_class.__name__} "
                    f"({self.name}){hint}",
                )  # fmt: skip
        if m.get("dropout", 0) > 0:
            yield ConfigIssue(
                "model.dropout", m["dropout"],
                f"{self.name} takes its own dropout fields in model.options (e.g. "
                "attention_dropout); model.dropout is for trainlab's own families",
            )  # fmt: skip
        kv = m.get("num_kv_heads")
        if kv not in (None, m["num_heads"]) and not self._has("num_key_value_heads"):
            yield ConfigIssue(
                "model.num_kv_heads", kv, f"{self.name} has no grouped-query attention"
            )
        if m.get("attention") not in ("auto", *ATTENTION_IMPLEMENTATIONS):
            yield ConfigIssue(
                "model.attention", m.get("attention"),
                f"{self.name} runs transformers' kernels: auto, sdpa, eager or flex",
            )  # fmt: skip
        if bad:
            return
        try:
            config = self.hf_config(m)
        except Exception as err:  # the family's own validation, in one line
            yield self._config_issue(m, err)
            return
        experts = self._experts_of(config)
        if experts and not 1 <= experts[1] <= experts[0]:
            yield ConfigIssue(
                "model.options.num_experts_per_tok", experts[1],
                f"must be between 1 and the number of experts ({experts[0]})",
            )  # fmt: skip
        reason = self.isolates_documents(m, config)
        if reason and not m.get("cross_document_attention"):
            yield cross_document_issue(self.name, reason)

    def _config_issue(self, m: Mapping[str, Any], err: Exception) -> ConfigIssue:
        text = " ".join(str(err).split())
        found = re.search(r"field '([A-Za-z0-9_]+)'", text)
        field = found.group(1) if found else None
        options = m.get("options") or {}
        by_theirs = {v: k for k, v in COMMON_FIELDS.items()}
        if field in options:
            return ConfigIssue(f"model.options.{field}", options[field], text)
        if field in by_theirs:
            ours = by_theirs[field]
            return ConfigIssue(f"model.{ours}", m.get(ours), text)
        return ConfigIssue("model.options", dict(options), text)

    def isolates_documents(self, m: Mapping[str, Any], config: Any = None) -> str | None:
        config = config if config is not None else self.hf_config(m)
        types = set(getattr(config, "layer_types", None) or ()) - MASKED_LAYER_TYPES
        if types:
            return f"{self.name} has layers of type {', '.join(sorted(types))}"
        mixers = sorted({n for n in self._modeling_classes() if STATEFUL_MIXERS.search(n)})
        if mixers:
            return f"{self.name} mixes tokens with {', '.join(mixers[:3])} (state along the row)"
        if not self._has("num_attention_heads"):
            return f"{self.name} has no attention layers"
        return None

    def _modeling_classes(self) -> list[str]:
        import importlib

        module = importlib.import_module(self.causal_lm_class().__module__)
        return [n for n, v in vars(module).items() if isinstance(v, type)]

    def causal_lm_class(self) -> type:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[self.model_type])

    # ------------------------------------------------------------------ facts
    def default_ffn_hidden_size(self, m: ModelSpec) -> int:
        return 4 * m.hidden_size

    def experts(self, m: ModelSpec) -> tuple[int, int] | None:
        return self._experts_of(self.hf_config(m))

    def _experts_of(self, config: Any) -> tuple[int, int] | None:
        total = next((getattr(config, n) for n in EXPERT_COUNT_FIELDS if self._has(n)), None)
        per_token = getattr(config, "num_experts_per_tok", None) if self._has(
            "num_experts_per_tok"
        ) else None
        if not total or not per_token:
            return None
        return int(total), int(per_token)

    def tensor_parallel_plan(self, m: Any) -> dict[str, str] | None:
        """The family's own `base_model_tp_plan`, from the wrapper's root
        (`hf.model.` + its keys); embeddings and the output head stay replicated."""
        try:
            config = self.hf_config(m if isinstance(m, Mapping) else _as_mapping(m))
        except Exception:  # noqa: BLE001 - invalid options: `check` reports them
            return None
        plan = dict(getattr(config, "base_model_tp_plan", None) or {})
        return {f"hf.model.{k}": v for k, v in plan.items()} or None

    def export_refusal(self, m: ModelSpec) -> str | None:
        return None

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Meta and fake tensors run an MoE's experts through transformers' own
        grouped-matmul fallback op (whose fake kernel gives the same shapes): in
        torch 2.13 the meta kernel of aten._grouped_mm accepts bfloat16 only."""
        from transformers.integrations import moe

        original = moe._can_use_grouped_mm
        moe._can_use_grouped_mm = lambda *args: False
        try:
            yield
        finally:
            moe._can_use_grouped_mm = original

    # ------------------------------------------------------------------ build
    def build_module(self, m: ModelSpec) -> nn.Module:
        import torch

        config = self.hf_config(m)
        cls = self.causal_lm_class()
        kwargs: dict[str, Any] = {"attn_implementation": "sdpa", "dtype": torch.float32}
        if self.experts(m):
            # One grouped matmul over the experts (meta and fake tensors can run it;
            # transformers' default loops over the experts a batch hits).
            kwargs["experts_implementation"] = "grouped_mm"
        model = cls._from_config(config, **kwargs)
        reason = self.isolates_documents(_as_mapping(m), config)
        return _define_wrapper()(model, m.attention, isolate=reason is None)

    def export(self, model: nn.Module, out: Any) -> None:
        """Write `model` (an HFCausalLM with trained weights) as a transformers
        directory (config.json, safetensors)."""
        model.hf.save_pretrained(str(out), safe_serialization=True)


def _as_mapping(m: Any) -> dict[str, Any]:
    dump = getattr(m, "model_dump", None)
    return dump() if dump is not None else dict(vars(m))


def __getattr__(name: str) -> Any:
    if name == "HFCausalLM":
        cls = _define_wrapper()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


@functools.cache
def _define_wrapper() -> type:
    import torch
    from torch import nn

    from trainlab.models.attention import AttentionMask
    from trainlab.models.base import resolve_attention
    from trainlab.models.layers import segment_positions

    class HFCausalLM(nn.Module):
        """A transformers causal LM called as trainlab calls its models:
        `model(input_ids, position_ids=None, document_ids=None) -> logits [B, T, V]`.

        Packed rows: positions restart at each document (from `document_ids` when
        not given) and, when the family isolates documents, attention gets the
        block-causal mask of the row (`AttentionMask.dense`; FlexAttention's block
        mask on CUDA), per layer type where the family mixes full and
        sliding-window layers. Parameters are the transformers model's, under
        `hf.` (so `hf.save_pretrained` exports them as they are)."""

        def __init__(self, hf_model: nn.Module, attention: str, isolate: bool = True):
            super().__init__()
            self.hf = hf_model
            self.attention = attention
            self.isolate = isolate
            self._impl: str | None = None

        def _set_implementation(self, device: torch.device) -> str:
            impl = resolve_attention(self.attention, device.type == "cuda")
            if impl != self._impl:
                self.hf.set_attn_implementation(ATTENTION_IMPLEMENTATIONS[impl])
                self._impl = impl
            return impl

        def _mask(self, impl: str, t: int, document_ids: torch.Tensor) -> Any:
            mask = AttentionMask(t, document_ids, impl)
            if impl == "flex":
                return mask.block()
            dense = mask.dense()
            config = self.hf.config
            window = getattr(config, "sliding_window", None)
            types = set(getattr(config, "layer_types", None) or ())
            if not window or (types and "sliding_attention" not in types):
                return dense
            i = torch.arange(t, device=dense.device)
            near = dense & ((i[:, None] - i[None, :]) < window)  # transformers' window
            if not types:  # a family whose every layer slides (e.g. mistral)
                return near
            out = {"full_attention": dense, "sliding_attention": near}
            return {k: v for k, v in out.items() if k in types}

        def forward(
            self,
            input_ids: torch.Tensor,
            position_ids: torch.Tensor | None = None,
            document_ids: torch.Tensor | None = None,
        ) -> torch.Tensor:
            b, t = input_ids.shape
            impl = self._set_implementation(input_ids.device)
            if position_ids is None:
                if document_ids is not None:
                    position_ids = segment_positions(document_ids)
                else:
                    position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
            mask = None
            if document_ids is not None and self.isolate:
                mask = self._mask(impl, t, document_ids)
            out = self.hf(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=mask,
                use_cache=False,
            )
            return out.logits

    return HFCausalLM
