"""`model.arch: hf:MODEL_TYPE`: transformers families built from scratch under
trainlab's forward contract, checked at validate by their own config class,
planned by measurement."""

from __future__ import annotations

import pytest
import torch

from trainlab.config import ExperimentConfig
from trainlab.config.loader import ConfigError, config_hash, override_name, validate_raw
from trainlab.models import build_model
from trainlab.models.registry import arch_of
from trainlab.plan import plan

transformers = pytest.importorskip("transformers")

MOE = {"num_experts": 8, "num_experts_per_tok": 2}


def cfg_of(**model) -> ExperimentConfig:
    base = {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "ffn_hidden_size": 96,
        "vocab_size": 512,
        "max_seq_len": 128,
    }
    return validate_raw({"name": "hf", "model": {**base, **model}, "data": {"seq_len": 64}})


def problems(**model) -> list[str]:
    with pytest.raises(ConfigError) as err:
        cfg_of(**model)
    return err.value.lines


def packed_row(vocab: int, lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
    docs = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, pos, docs


@pytest.mark.parametrize(
    "model",
    [
        {"arch": "hf:llama"},
        {"arch": "hf:qwen3_moe", "options": MOE},
        # every layer sliding-window (a window shorter than the documents)
        {"arch": "hf:mistral", "options": {"sliding_window": 8}},
        # full and sliding-window layers mixed: a mask per layer type
        {"arch": "hf:gemma3_text", "num_kv_heads": 4,
         "options": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}},
    ],
    ids=lambda m: m["arch"],
)
def test_a_packed_document_sees_only_itself(model):
    """The logits of each document of a packed row equal those of the document run
    alone (positions from 0, no neighbour), within 1e-5."""
    cfg = cfg_of(**model)
    torch.manual_seed(0)
    net = build_model(cfg.model).eval()
    lengths = [23, 30, 11]
    ids, pos, docs = packed_row(cfg.model.vocab_size, lengths)
    with torch.no_grad():
        packed = net(ids, position_ids=pos, document_ids=docs)
        start = 0
        for n in lengths:
            alone = net(ids[:, start : start + n])
            assert (packed[:, start : start + n] - alone).abs().max().item() < 1e-5
            start += n
        # and without the mask the documents do leak: the check can fail
        leaked = net(ids)[:, lengths[0] :]
    assert (leaked - packed[:, lengths[0] :]).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    "arch, options",
    [("hf:llama", {}), ("hf:qwen3_moe", MOE), ("hf:gpt2", {"n_inner": None})],
)
def test_plan_counts_the_parameters_transformers_builds(arch, options):
    model = {"arch": arch, "options": options}
    if arch == "hf:gpt2":
        model["num_kv_heads"] = None
    cfg = cfg_of(**model)
    config = arch_of(cfg.model).hf_config(cfg.model)
    reference = transformers.AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in reference.parameters())
    got = plan(cfg)
    assert got.num_params == expected
    assert sum(p.numel() for p in build_model(cfg.model).parameters()) == expected
    if arch == "hf:qwen3_moe":
        experts = sum(
            p.numel() for n, p in reference.named_parameters() if ".experts." in n
        )
        assert got.num_params_active == expected - experts * (1 - 2 / 8)
        assert got.to_json()["num_params_active"] == got.num_params_active
    else:
        assert got.num_params_active is None


def test_moe_flops_come_from_the_active_parameters():
    dense = plan(cfg_of(arch="hf:qwen3_moe", options={**MOE, "num_experts_per_tok": 1}))
    wider = plan(cfg_of(arch="hf:qwen3_moe", options={**MOE, "num_experts_per_tok": 4}))
    assert wider.num_params == dense.num_params
    # 3 more experts per token: 6 FLOPs per parameter of three experts per layer
    expert = 3 * 64 * 96  # gate, up, down of one expert
    assert wider.flops_per_token - dense.flops_per_token == pytest.approx(6 * 3 * expert * 2)


def test_options_are_checked_by_the_family_one_line_each():
    lines = problems(
        arch="hf:qwen3_moe",
        options={"num_experts": 4, "num_experts_per_tok": 2, "hidden_sise": 3, "num_hidden_layers": 9},
    )
    assert any(
        "model.options.hidden_sise = 3: not a field of transformers' Qwen3MoeConfig "
        "(hf:qwen3_moe); did you mean 'hidden_size'?" in line for line in lines
    ), lines
    assert any(
        "model.options.num_hidden_layers = 9: is model.num_layers for hf:qwen3_moe" in line
        for line in lines
    ), lines
    typed = problems(arch="hf:llama", options={"rms_norm_eps": "tiny"})
    assert len(typed) == 1 and typed[0].startswith("model.options.rms_norm_eps = 'tiny'")
    top = problems(arch="hf:qwen3_moe", options={"num_experts": 4, "num_experts_per_tok": 6})
    assert "must be between 1 and the number of experts (4)" in top[0]
    unknown = problems(arch="hf:lama")
    assert "did you mean hf:llama" in unknown[0]


def test_a_family_that_cannot_isolate_documents_is_refused_unless_accepted():
    lines = problems(arch="hf:qwen3_next", num_kv_heads=2)
    assert any("layers of type linear_attention" in line and "cross_document_attention" in line
               for line in lines), lines
    cfg = cfg_of(arch="hf:qwen3_next", cross_document_attention=True)
    assert cfg.model.cross_document_attention


def test_an_option_is_part_of_the_experiment():
    a = cfg_of(arch="hf:qwen3_moe", options=MOE)
    b = cfg_of(arch="hf:qwen3_moe", options={**MOE, "norm_topk_prob": False})
    assert config_hash(a) != config_hash(b)
    assert override_name("moe", ["model.options.norm_topk_prob=false"]) == "moe_norm_topk_prob-false"
