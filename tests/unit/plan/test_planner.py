"""The planner against published counts and hand-computed formulas."""

from __future__ import annotations

import re

import pytest

from trainlab.config import ExperimentConfig, ModelConfig
from trainlab.errors import UserError
from trainlab.plan import (
    activation_bytes,
    activation_bytes_per_layer,
    count_params,
    flops_per_token,
    model_state_bytes,
    plan,
    require_fit,
    resolve_layout,
)
from trainlab.plan.model_math import GiB

GPT2_SMALL = ModelConfig(
    arch="gpt2",
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    vocab_size=50257,
    max_seq_len=1024,
    tie_embeddings=True,
)
LLAMA2_7B = ModelConfig(
    arch="llama",
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    ffn_hidden_size=11008,
    vocab_size=32000,
    max_seq_len=4096,
    tie_embeddings=False,
)


def test_published_parameter_counts():
    assert count_params(GPT2_SMALL).total == 124_439_808
    assert count_params(LLAMA2_7B).total == 6_738_415_616


def test_param_count_pieces():
    # GQA shrinks k/v projections: Llama-2-70B shapes give the published 68,976,648,192.
    llama70 = ModelConfig(
        arch="llama",
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        ffn_hidden_size=28672,
        vocab_size=32000,
        tie_embeddings=False,
    )
    assert count_params(llama70).total == 68_976_648_192
    tied = count_params(LLAMA2_7B.model_copy(update={"tie_embeddings": True}))
    assert count_params(LLAMA2_7B).total - tied.total == 32000 * 4096
    pc = count_params(GPT2_SMALL)
    assert pc.position == 1024 * 768 and pc.head == 0
    assert pc.non_embedding == pc.total - 50257 * 768 - 1024 * 768


@pytest.mark.parametrize(
    "stage, params, grads, opt",
    [
        (0, 2, 2, 12),
        (1, 2, 2, 12 / 8),
        (2, 2, 2 / 8, 12 / 8),
        (3, 2 / 8, 2 / 8, 12 / 8),
    ],
)
def test_zero_stages_mixed_precision(stage, params, grads, opt):
    # ZeRO paper, fig. 1: psi = 7.5B, Nd = 64 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB; here dp = 8.
    psi = 1_000_000
    m = model_state_bytes(psi, "bf16", stage, dp=8)
    assert m == pytest.approx(
        {"params": params * psi, "grads": grads * psi, "optimizer": opt * psi}
    )


def test_zero_paper_figure_1():
    psi, nd = 7.5e9, 64
    totals = [sum(model_state_bytes(psi, "bf16", s, nd).values()) / 1e9 for s in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.875], rel=1e-2)


def test_fp32_states_and_model_parallel_split():
    m = model_state_bytes(1000, "fp32", 0, dp=4, model_parallel=2)
    assert m == {"params": 2000, "grads": 2000, "optimizer": 4000}


def test_activation_formula_matches_paper_for_gpt_blocks():
    # Korthikanti et al. 2022, GPT-3 175B row of table 2: s=2048, h=12288, a=96, t=8, b=1.
    m = ModelConfig(
        arch="gpt2",
        hidden_size=12288,
        num_layers=96,
        num_heads=96,
        vocab_size=51200,
        max_seq_len=2048,
    )
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    kw = dict(precision="bf16")
    assert activation_bytes_per_layer(m, s, b, **kw) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(m, s, b, tp=t, **kw) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t))
    )
    assert activation_bytes_per_layer(m, s, b, tp=t, sequence_parallel=True, **kw) == pytest.approx(
        sbh / t * (34 + 5 * a * s / h)
    )
    assert activation_bytes_per_layer(
        m, s, b, tp=t, sequence_parallel=True, recompute="selective", **kw
    ) == pytest.approx(34 * sbh / t)
    assert activation_bytes_per_layer(m, s, b, recompute="full", **kw) == pytest.approx(2 * sbh)
    # fp32 activations take twice the bytes.
    assert activation_bytes_per_layer(m, s, b, precision="fp32") == pytest.approx(
        2 * sbh * (34 + 5 * a * s / h)
    )
    # Whole model: layers + embedding dropout + output layer (4sbh/t (1 + v/h)).
    total = activation_bytes(m, s, b, tp=t, pp=1, sequence_parallel=True, recompute="selective")
    assert total == pytest.approx(96 * 34 * sbh / t + sbh / t + 4 * sbh / t * (1 + 51200 / h))


def test_activation_constants_for_swiglu_and_gqa():
    # llama block: attention 7 + 4*g, MLP 3 + 8*f/h, norms 4.
    m = ModelConfig(
        arch="llama",
        hidden_size=1024,
        num_layers=1,
        num_heads=16,
        num_kv_heads=4,
        ffn_hidden_size=2048,
        vocab_size=1000,
    )
    s, b = 512, 2
    expected_const = (7 + 4 * 0.25) + (3 + 8 * 2) + 4
    assert activation_bytes_per_layer(m, s, b, recompute="selective") == pytest.approx(
        s * b * 1024 * expected_const
    )


def test_flops_per_token_palm():
    pc = count_params(GPT2_SMALL)
    n = pc.total - pc.embedding - pc.position + pc.embedding  # tied head still multiplies
    assert flops_per_token(GPT2_SMALL, 1024) == 6 * n + 12 * 12 * 12 * 64 * 1024


def cfg(**over) -> ExperimentConfig:
    base = {
        "name": "t",
        "model": LLAMA2_7B.model_dump(),
        "data": {"seq_len": 4096, "micro_batch_size": 1},
        "train": {"precision": "bf16"},
        "parallel": {"strategy": "auto", "activation_checkpointing": "selective"},
        "resource": {"num_workers": 8, "use_gpu": True, "gpu_memory_gb": 80, "gpus_per_node": 8},
    }
    for key, value in over.items():
        if "__" not in key:
            base[key] = value
            continue
        section, field = key.split("__")
        base[section][field] = value
    return ExperimentConfig.model_validate(base)


def test_auto_prefers_zero_sharding_before_tensor_parallel():
    p = plan(cfg())
    assert p.fits
    # 7B x 16 B = 108 GB of states cannot be replicated on 80 GB; ZeRO over dp=8 fits first.
    assert p.parallel["tp"] == 1 and p.parallel["pp"] == 1 and p.parallel["dp"] == 8
    assert p.parallel["zero_stage"] in (1, 2, 3) and p.strategy in ("ddp", "fsdp")
    mem = p.memory_per_device_bytes
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))
    assert mem["total"] <= p.usable_memory_bytes


def test_auto_picks_tensor_then_pipeline_parallelism_when_zero_cannot_shard():
    # Without ZeRO (the user pinned stage 0), 7B states need model parallelism: tensor
    # parallelism within a node first, and the trainer runs it.
    node8 = plan(cfg(parallel__zero_stage=0))
    assert node8.fits and node8.parallel["pp"] == 1 and node8.parallel["tp"] > 1
    assert node8.would_fit_with_tp_pp is None
    # Two GPUs per node: tp stops at 2, the rest comes from pipeline stages, which
    # need micro batches to pipeline: one sequence per replica cannot be. (64 GB: on
    # 80 GB the 7B fits at tp=2 since the fused optimizer, FlexAttention and the
    # chunked loss.)
    small = {"resource__gpu_memory_gb": 64, "parallel__zero_stage": 0}
    node2 = plan(cfg(resource__gpus_per_node=2, **small))
    assert not node2.fits
    assert any("cannot fill a pipeline of pp=" in n for n in node2.notes)
    batch = {"data__global_batch_size": 64, "data__micro_batch_size": "auto"}
    node2 = plan(cfg(resource__gpus_per_node=2, **small, **batch))
    assert node2.fits and node2.parallel["tp"] <= 2 and node2.parallel["pp"] > 1
    # One GPU per node: tp cannot leave the node at all.
    node1 = plan(cfg(resource__gpus_per_node=1, **small, **batch))
    assert node1.fits and node1.parallel["tp"] == 1 and node1.parallel["pp"] > 1
    # The layout it picks validates and runs as configured.
    resolved = resolve_layout(cfg(resource__gpus_per_node=1, **small, **batch))
    assert resolved.parallel.pp == node1.parallel["pp"]
    assert resolved.pipeline_microbatches >= node1.parallel["pp"]


def test_auto_with_less_memory_shards_more():
    stages = [plan(cfg(resource__gpu_memory_gb=gb)).parallel["zero_stage"] for gb in (80, 64, 40)]
    assert stages == sorted(stages) and stages[-1] == 3


def test_nothing_fits_is_a_clear_error():
    p = plan(cfg(resource__gpu_memory_gb=1, resource__num_workers=1))
    assert not p.fits
    with pytest.raises(
        UserError,
        match=r"does not fit: .* GiB per device > usable .* GiB of "
        r"1\.00 GiB device memory",
    ):
        require_fit(p)


def test_explicit_layout_is_checked_not_changed():
    p = plan(cfg(parallel__strategy="ddp", parallel__zero_stage=0))
    assert p.parallel == {"tp": 1, "pp": 1, "dp": 8, "zero_stage": 0}
    assert not p.fits  # 16 B/param replicated = 108 GB > 80 GB
    with pytest.raises(UserError, match="per device > usable"):
        require_fit(p)


def test_micro_batch_max_is_the_largest_that_fits():
    p = plan(cfg())
    assert p.micro_batch_size_max >= 1
    c = cfg()
    at_max = plan(cfg(data__micro_batch_size=p.micro_batch_size_max))
    over = plan(cfg(data__micro_batch_size=p.micro_batch_size_max + 1))
    assert at_max.fits and at_max.parallel == p.parallel
    assert (
        over.memory_per_device_bytes["total"] > p.usable_memory_bytes or over.parallel != p.parallel
    )
    assert c.data.micro_batch_size == 1


def test_resolve_layout_makes_strategy_concrete():
    c = resolve_layout(cfg())
    assert c.parallel.strategy in ("ddp", "fsdp") and c.parallel.dp == 8
    assert c.global_batch_size == 8


def test_cpu_plan_uses_host_memory_per_worker():
    c = cfg(
        resource__use_gpu=False,
        resource__cpu_memory_gb=4.0,
        resource__num_workers=2,
        model__hidden_size=256,
        model__num_heads=4,
        model__num_kv_heads=None,
        model__num_layers=2,
        model__ffn_hidden_size=512,
        data__seq_len=128,
        train__precision="fp32",
    )
    p = plan(c)
    assert p.device_memory_bytes == 4 * GiB and p.fits


# --------------------------------------------------------------------------- levers

LLAMA2_70B = ModelConfig(
    arch="llama",
    hidden_size=8192,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    ffn_hidden_size=28672,
    vocab_size=32000,
    max_seq_len=4096,
    tie_embeddings=False,
)


def cfg70(**over) -> ExperimentConfig:
    """70B on 64 x 80 GB, the experiment's global batch 1024 sequences."""
    return cfg(
        model=LLAMA2_70B.model_dump(),
        data__global_batch_size=1024,
        resource__num_workers=64,
        **over,
    )


def test_global_batch_is_the_experiments_across_recompute_modes():
    # Before: 128, 256 or 1024 sequences per step depending only on recomputation.
    for mode in ("none", "selective", "full", "auto"):
        for mb in ("auto", 1):
            c = cfg70(parallel__activation_checkpointing=mode, data__micro_batch_size=mb)
            assert c.global_batch_size == 1024 and c.tokens_per_step == 1024 * 4096
            p = plan(c)
            lay = p.parallel
            assert p.global_batch_size == 1024 and p.tokens_per_step == 1024 * 4096, (mode, mb)
            assert p.micro_batch_size * p.grad_accum_steps * lay["dp"] == 1024, (mode, mb)
            assert any(n.startswith("global batch 1024 sequences") for n in p.notes)
            if p.fits:
                r = resolve_layout(c, p)
                assert r.global_batch_size == 1024
                assert r.data.grad_accum_steps == p.grad_accum_steps
                assert r.data.micro_batch_size == p.micro_batch_size
                assert r.parallel.activation_checkpointing == p.activation_checkpointing


def test_without_a_global_batch_it_follows_dp_and_the_plan_says_so():
    p = plan(cfg(data__grad_accum_steps=2))
    assert p.global_batch_size == 1 * 2 * p.parallel["dp"]
    assert p.grad_accum_steps == 2
    assert any("set data.global_batch_size" in n for n in p.notes)


def test_layouts_whose_dp_does_not_divide_the_global_batch_are_skipped():
    p = plan(cfg(data__global_batch_size=12))  # 8 workers
    assert any(n.startswith("skipped dp=8: data.global_batch_size 12") for n in p.notes)
    # tensor parallelism over pairs leaves dp=4, which divides it
    assert p.fits and p.parallel["dp"] in (1, 2, 4) and 12 % p.parallel["dp"] == 0


def _fits(**over) -> bool:
    """Whether `over` fits with data parallelism alone (the levers before tp/pp)."""
    return plan(cfg(**{"parallel__tp": 1, "parallel__pp": 1, **over})).fits


def test_recomputation_is_tried_in_order_and_said():
    # 7B at 4k context, micro batch 8: without recomputation the activations alone
    # exceed the device.
    over = {"data__micro_batch_size": 8}
    auto = plan(cfg(parallel__activation_checkpointing="auto", **over))
    assert auto.fits
    first = next(
        m
        for m in ("none", "selective", "full")
        if _fits(parallel__activation_checkpointing=m, **over)
    )
    assert first != "none" and auto.activation_checkpointing == first
    assert auto.micro_batch_size == 8  # stated, so respected
    pinned = plan(cfg(parallel__activation_checkpointing=first, **over))
    assert auto.parallel == pinned.parallel
    assert auto.memory_per_device_bytes == pinned.memory_per_device_bytes
    prev = "none" if first == "selective" else "selective"
    assert any(
        re.fullmatch(
            rf"activation_checkpointing: {first} \(auto; {prev} did not fit: "
            r"[\d.]+ GiB > 72\.0 GiB\)",
            n,
        )
        for n in auto.notes
    ), auto.notes
    resolved = resolve_layout(cfg(parallel__activation_checkpointing="auto", **over))
    assert resolved.parallel.activation_checkpointing == first
    assert resolved.data.micro_batch_size == 8


def test_explicit_recomputation_and_micro_batch_are_respected():
    p = plan(
        cfg(
            parallel__activation_checkpointing="none",
            data__micro_batch_size=4,
            parallel__tp=1,
            parallel__pp=1,
        )
    )
    assert not p.fits and p.activation_checkpointing == "none" and p.micro_batch_size == 4
    assert p.parallel["tp"] == p.parallel["pp"] == 1
    (fix,) = [n for n in p.notes if n.startswith("to fit now")]
    assert "parallel.activation_checkpointing: " in fix


def test_levers_in_order_zero_then_micro_batch_then_recomputation():
    # Both levers open: a global batch of 512 = 64 sequences per rank on 8 GPUs.
    c = cfg(
        data__global_batch_size=512,
        data__micro_batch_size="auto",
        parallel__activation_checkpointing="auto",
    )
    p = plan(c)
    assert p.fits and p.parallel["tp"] == p.parallel["pp"] == 1
    mode, mb, z = p.activation_checkpointing, p.micro_batch_size, p.parallel["zero_stage"]
    assert mb < 64 and p.grad_accum_steps == 64 // mb  # the micro batch lever moved

    def fits(mode: str, mb: int, z: int) -> bool:
        return _fits(
            data__global_batch_size=512,
            data__micro_batch_size=mb,
            parallel__activation_checkpointing=mode,
            parallel__zero_stage=z,
        )

    ladder = ["none", "selective", "full"]
    assert fits(mode, mb, z)
    # ZeRO first: no lower stage fits at the chosen recomputation and micro batch.
    assert not any(fits(mode, mb, lower) for lower in range(z))
    # Then the micro batch: no larger one fits at this recomputation, at any stage.
    larger = [x for x in (2, 4, 8, 16, 32, 64) if x > mb]
    assert not any(fits(mode, x, s) for x in larger for s in range(4))
    # Recomputation last: no cheaper mode fits even at micro batch 1.
    cheaper = ladder[: ladder.index(mode)]
    assert not any(fits(m, 1, s) for m in cheaper for s in range(4))
    assert any(n.startswith(f"micro_batch_size: {mb} (auto; ") for n in p.notes)
    r = resolve_layout(c, p)
    assert (r.data.micro_batch_size, r.data.grad_accum_steps) == (mb, 64 // mb)
    assert r.global_batch_size == 512


@pytest.mark.parametrize("gb", [24, 48, 80])
@pytest.mark.parametrize("per_node", [1, 8])
@pytest.mark.parametrize("zero", [None, 0])
def test_auto_picks_only_layouts_the_trainer_runs(gb, per_node, zero):
    for c in (
        cfg(
            resource__gpu_memory_gb=gb, resource__gpus_per_node=per_node, parallel__zero_stage=zero
        ),
        cfg70(
            resource__gpu_memory_gb=gb, resource__gpus_per_node=per_node, parallel__zero_stage=zero
        ),
    ):
        p = plan(c)
        lay = p.parallel
        assert not (lay["zero_stage"] == 1 and lay["dp"] > 1 and lay["tp"] * lay["pp"] > 1)
        assert lay["tp"] <= per_node
        if p.fits:  # the resolved config passes every rule the trainer's layout needs
            r = resolve_layout(c, p)
            assert (r.parallel.tp, r.parallel.pp) == (lay["tp"], lay["pp"])
            assert lay["pp"] == 1 or r.pipeline_microbatches is not None


def test_nodes_needed():
    assert plan(cfg()).nodes == 1
    p = plan(cfg70())
    assert p.nodes == 8 and p.to_json()["nodes"] == 8
    assert any(n.startswith("needs 8 nodes for 64 workers") for n in p.notes)
    assert plan(cfg(resource__num_workers=12, data__micro_batch_size=1)).nodes == 2
    assert not any("nodes" in n for n in plan(cfg()).notes)
    cpu = cfg(
        resource__use_gpu=False,
        resource__cpu_memory_gb=4.0,
        resource__num_workers=16,
        model=GPT2_SMALL.model_dump(),
        data__seq_len=128,
    )
    assert plan(cpu).nodes == 1


def test_plan_json_fields():
    c = cfg(
        data__global_batch_size=64,
        data__micro_batch_size="auto",
        parallel__activation_checkpointing="auto",
    )
    j = plan(c).to_json()
    for key in ("nodes", "grad_accum_steps", "activation_checkpointing", "would_fit_with_tp_pp"):
        assert key in j
    assert j["activation_checkpointing"] in ("none", "selective", "full")
    assert j["micro_batch_size"] * j["grad_accum_steps"] * j["parallel"]["dp"] == 64
    assert j["nodes"] == 1 and j["would_fit_with_tp_pp"] is None and j["fits"]
