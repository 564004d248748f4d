"""The memory estimate against a trace of the real training step at full size
(trainlab.train.memtrace: the trainer's own model, parallel wrapping and step on fake
tensors and a fake process group, measured by torch's memory trackers).

The matrix covers every pair of (strategy, precision, recomputation) at least
once, on 1B-, 7B- and 70B-class Llama and GPT-2 small shapes (a pairwise design: the
full cross product of 96 traces does not fit the unit-test budget; `make bench`
reports the worst error over a larger one). The 70B-class case keeps the
70B's layer and vocabulary shapes with 8 of its 80 layers: every per-layer and
per-model term is there, and the trace takes seconds, not a minute."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import RECIPES, REPO
from trainlab.config import ExperimentConfig
from trainlab.errors import UserError
from trainlab.plan import Layout, estimate_memory
from trainlab.plan.memory import CATEGORIES
from trainlab.train.memtrace import trace_step

pytest.importorskip("torch")

MODELS = {
    # Llama-3.2-1B shapes (GQA 32/8, tied 128k vocabulary)
    "llama1b": dict(
        arch="llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        ffn_hidden_size=8192, vocab_size=128256, max_seq_len=4096, tie_embeddings=True,
    ),
    # Llama-2-7B
    "llama7b": dict(
        arch="llama", hidden_size=4096, num_layers=32, num_heads=32, ffn_hidden_size=11008,
        vocab_size=32000, max_seq_len=4096, tie_embeddings=False,
    ),
    # Llama-3-70B layer and vocabulary shapes, 8 of 80 layers
    "llama70b_8": dict(
        arch="llama", hidden_size=8192, num_layers=8, num_heads=64, num_kv_heads=8,
        ffn_hidden_size=28672, vocab_size=128256, max_seq_len=4096, tie_embeddings=False,
    ),
    "gpt2": dict(
        arch="gpt2", hidden_size=768, num_layers=12, num_heads=12, vocab_size=50257,
        max_seq_len=1024, tie_embeddings=True,
    ),
    # Wide blocks, a small vocabulary and short rows: the optimizer step is the peak
    # (Muon's gathered update and Newton-Schulz working set of the 4096 x 14336 MLP).
    "wide": dict(
        arch="llama", hidden_size=4096, num_layers=4, num_heads=32, num_kv_heads=8,
        ffn_hidden_size=14336, vocab_size=512, max_seq_len=256, tie_embeddings=False,
    ),
    "tiny": dict(
        arch="gpt2", hidden_size=64, num_layers=2, num_heads=4, vocab_size=256,
        max_seq_len=64, tie_embeddings=True,
    ),
}  # fmt: skip


def make_cfg(
    model, precision, recompute, world, *, gpu=True, accum=1, async_save=False, optimizer="adamw"
):
    m = MODELS[model]
    return ExperimentConfig.model_validate(
        {
            "name": "trace",
            "model": m,
            "data": {"seq_len": m["max_seq_len"], "micro_batch_size": 1, "grad_accum_steps": accum},
            "train": {
                "precision": precision,
                "checkpoint": {"async_save": async_save},
                "optimizer": {"name": optimizer},
            },
            "parallel": {"activation_checkpointing": recompute},
            "resource": {"num_workers": world, "use_gpu": gpu},
        }
    )


# (model, zero stage, precision, recomputation, dp, extras): every pair of strategy x
# precision, strategy x recomputation and precision x recomputation at least once.
MATRIX = [
    ("gpt2", 0, "bf16", "none", 8, {"async_save": True}),
    ("llama1b", 0, "fp32", "selective", 8, {}),
    ("gpt2", 0, "bf16", "full", 2, {"gpu": False}),
    ("gpt2", 1, "fp32", "none", 8, {}),
    ("llama7b", 1, "bf16", "selective", 8, {}),
    ("gpt2", 1, "bf16", "full", 8, {"accum": 2}),
    ("llama1b", 2, "bf16", "none", 8, {}),
    ("gpt2", 2, "fp32", "selective", 8, {}),
    ("gpt2", 2, "fp32", "full", 8, {}),
    ("llama1b", 3, "bf16", "none", 8, {}),
    ("gpt2", 3, "bf16", "selective", 8, {"accum": 2}),
    ("llama1b", 3, "fp32", "full", 8, {}),
    ("llama70b_8", 3, "bf16", "full", 64, {}),
    # Muon (trainlab.optim.muon): its state, ZeRO-1's share of its groups, FSDP's
    # shards, and its step where the step is the peak.
    ("llama1b", 0, "bf16", "none", 8, {"optimizer": "muon"}),
    ("gpt2", 1, "bf16", "full", 8, {"optimizer": "muon"}),
    ("llama1b", 3, "bf16", "none", 8, {"optimizer": "muon"}),
    ("wide", 0, "bf16", "full", 1, {"optimizer": "muon"}),
    ("wide", 0, "fp32", "full", 2, {"optimizer": "muon", "gpu": False}),
]


def _id(case):
    model, z, precision, recompute, dp, extra = case
    more = "".join(f"-{k}={v}" for k, v in extra.items())
    return f"{model}-z{z}-{precision}-{recompute}-dp{dp}{more}"


@pytest.mark.parametrize("case", MATRIX, ids=_id)
def test_estimate_within_10_percent_of_the_trace(case):
    model, zero, precision, recompute, dp, extra = case
    cfg = make_cfg(model, precision, recompute, dp, **extra)
    layout = Layout(1, 1, dp, zero)
    traced = trace_step(cfg, layout, 1)
    est = estimate_memory(cfg, layout, 1)
    t, e = traced.memory, est.memory
    assert set(t) == set(e) == {*CATEGORIES, "total"}
    assert t["total"] == pytest.approx(sum(t[k] for k in CATEGORIES))
    # The totals, with and without the framework constant both carry.
    assert abs(e["total"] / t["total"] - 1) <= 0.10, (est.phase, traced.phase)
    tensors = (e["total"] - e["framework"]) / (t["total"] - t["framework"]) - 1
    assert abs(tensors) <= 0.10, (est.phase, traced.phase, e, t)
    # Categories that do not move during the step match closely.
    assert e["optimizer"] == pytest.approx(t["optimizer"], rel=0.02, abs=2**20)
    assert e["checkpoint_snapshot"] == pytest.approx(t["checkpoint_snapshot"], rel=0.02)
    if model == "wide":  # the case is there to check the optimizer step's figures
        assert est.phase == traced.phase == "optimizer"
    if zero < 2:
        assert e["parameters"] == pytest.approx(t["parameters"], rel=0.01)
        assert e["communication"] == pytest.approx(t["communication"], rel=0.01)


def test_trace_leaves_no_global_state():
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import torch.nn.parallel.distributed as ddp_mod
    from torch._guards import active_fake_mode
    from torch.optim import optimizer as optim_mod

    def pipelining_patched():
        import copy

        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.pipelining import schedules, stage

        import trainlab.train.parallel.pipeline as pipeline_mod

        return (
            pipeline_mod.copy is copy,
            vars(DeviceMesh)["_concatenate"],
            vars(schedules._PipelineSchedule)["_warmup_p2p"],
            "_warmup_p2p" in vars(schedules.PipelineScheduleSingle),
            vars(stage.PipelineStage)["_send_meta"],
            vars(stage.PipelineStage)["_recv_meta"],
        )

    patched_before = pipelining_patched()
    before = (
        torch.get_rng_state(),
        F.layer_norm,
        ddp_mod._verify_param_shape_across_processes,
        len(optim_mod._global_optimizer_pre_hooks),
        len(optim_mod._global_optimizer_post_hooks),
    )
    trace_step(make_cfg("tiny", "bf16", "full", 2), Layout(1, 1, 2, 3), 1)
    trace_step(make_cfg("tiny", "bf16", "selective", 2), Layout(1, 1, 2, 0), 1)
    # tp x pp (GPT-2 keeps replicated parameters beside the tp shards: on a CPU
    # target AdamW's per-tensor loop steps that mix).
    trace_step(make_cfg("tiny", "bf16", "none", 4, accum=2, gpu=False), Layout(2, 2, 1, 0), 1)
    after = (
        torch.get_rng_state(),
        F.layer_norm,
        ddp_mod._verify_param_shape_across_processes,
        len(optim_mod._global_optimizer_pre_hooks),
        len(optim_mod._global_optimizer_post_hooks),
    )
    assert pipelining_patched() == patched_before
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
    assert not dist.is_initialized()
    assert active_fake_mode() is None
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")


def test_single_device_and_refusals():
    cfg = make_cfg("tiny", "fp32", "none", 1)
    r = trace_step(cfg, Layout(1, 1, 1, 0), 1)
    assert r.world_size == 1 and r.memory["communication"] == 0
    assert (
        abs(estimate_memory(cfg, Layout(1, 1, 1, 0), 1).memory["total"] / r.memory["total"] - 1)
        < 0.1
    )
    # What the trainer refuses to run, the trace refuses to trace.
    with pytest.raises(UserError, match="ZeRO-1"):
        trace_step(make_cfg("tiny", "bf16", "none", 4), Layout(2, 1, 2, 1), 1)


# Tensor and pipeline parallelism: the tiny recipe at tp=2 and at pp=2 (1F1B), dp=1,
# as `trainlab plan --trace --set ...` traces them. The estimate for tp/pp is the
# paper model (trainlab.plan.memory); measured against the trace it is not within
# the 10% the data-parallel matrix holds once the framework constant is left out:
# (total error, tensors-only error) as measured, and the bound each is held to.
#
# tp=2: -2.2% / -14.7%. Activations and model state match (the tp shards are
# 1/tp); the estimate counts DDP's gradient buckets, which no tp layout allocates
# (dp=1: no wrapper; dp>1: FSDP2's replicate), and 12 bytes per vocabulary-parallel
# logit where torch's loss_parallel holds 16 at its peak.
# pp=2: +7.4% / +73%. The busiest rank is the last stage (the head, the loss and
# a copy of the tied table). The estimate splits the parameters P/pp, where this
# vocabulary-dominated model puts the 8192 x 128 table on both stages; holds no
# gradients at its forward peak, where 1F1B's last stage runs its second forward
# after the first backward; and takes the data micro batch (8 rows) as the
# pipeline's, where the schedule splits the step's rows into pp micro batches of
# 4 (activations and logits per micro batch half the estimate's), and counts DDP
# buckets where the trace finds the schedule's receive buffers.
TP_PP = {
    "tp2": (["parallel.strategy=ddp", "parallel.tp=2", "parallel.dp=1"], 0.10, 0.16),
    "pp2": (["parallel.pp=2", "parallel.dp=1"], 0.10, 0.75),
}


@pytest.mark.parametrize("name", sorted(TP_PP))
def test_tp_and_pp_estimate_against_the_trace(name):
    from trainlab.config import load_config
    from trainlab.plan import plan, resolve_layout

    overrides, total_bound, tensors_bound = TP_PP[name]
    cfg = load_config(RECIPES / "tiny.yaml", overrides)
    p = plan(cfg)
    layout, mb = Layout(**p.parallel), p.micro_batch_size
    cfg = resolve_layout(cfg, p)
    traced = trace_step(cfg, layout, mb)
    est = estimate_memory(cfg, layout, mb)
    t, e = traced.memory, est.memory
    assert set(t) == set(e) == {*CATEGORIES, "total"}
    assert t["total"] == pytest.approx(sum(t[k] for k in CATEGORIES))
    assert traced.world_size == 2
    assert abs(e["total"] / t["total"] - 1) <= total_bound, (e, t)
    tensors = (e["total"] - e["framework"]) / (t["total"] - t["framework"]) - 1
    assert abs(tensors) <= tensors_bound, (tensors, e, t)
    if name == "tp2":
        # The shards: 1/tp of the model state, as the estimate has it.
        assert e["parameters"] == pytest.approx(t["parameters"], rel=0.01)
        assert e["optimizer"] == pytest.approx(t["optimizer"], rel=0.02)
        assert e["activations"] == pytest.approx(t["activations"], rel=0.05)
        assert traced.rank == 0 and traced.rank_totals == {}
    else:
        # Both pipeline ranks traced; the last stage is the busier one. Each holds
        # its stage's parameters (embedding + block 0; block 1 + norm + the table's
        # copy), gradients and AdamW's two moments of them.
        assert sorted(traced.rank_totals) == [0, 1] and traced.rank == 1
        assert traced.rank_totals[1] == t["total"] > traced.rank_totals[0]
        assert t["optimizer"] == pytest.approx(2 * t["parameters"], rel=0.01)
        assert t["gradients"] == pytest.approx(t["parameters"], rel=0.01)
        assert 0 < t["communication"] < t["activations"]  # the receive buffers


@pytest.mark.parametrize("overrides", [(), ("parallel.pp=2", "parallel.dp=1")], ids=["dp2", "pp2"])
def test_plan_trace_cli_json(overrides):
    sets = [arg for o in overrides for arg in ("--set", o)]
    out = subprocess.run(
        [sys.executable, "-m", "trainlab", "plan", str(RECIPES / "tiny.yaml"), "--trace", "--json"]
        + sets,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout.strip().splitlines()[-1])
    traced = p["traced_memory_per_device_bytes"]
    assert set(traced) == set(p["memory_per_device_bytes"]) == {*CATEGORIES, "total"}
    assert abs(p["estimate_error"]) <= 0.10
    assert p["estimate_error"] == pytest.approx(
        p["memory_per_device_bytes"]["total"] / traced["total"] - 1, abs=1e-3
    )
    assert p["trace"]["peak_phase"] in ("forward", "backward", "clip", "optimizer")
    assert p["trace"]["rank"] == (1 if overrides else 0)  # pp: the busiest pipeline rank


# Mixture of experts (model.moe, docs/moe.md) at ep=1: the MoE layers' router, dispatch
# buffers and grouped experts against the trace. The trace runs on CPU fake tensors,
# where the experts would take paths a GPU run does not and fake tensors cannot run
# (fp32: the CPU grouped GEMM, whose meta kernel takes bf16 only; bf16: the padded
# batched matmul, which reads the busiest expert's row count back, data that fake
# tensors do not have). A GPU bf16 run takes `torch._grouped_mm`, whose meta kernel
# does run on fakes: the trace has the experts take it, as the CUDA target would
# (memtrace `_experts_as_on_gpu`). Routing on fake tensors is balanced in shape only:
# the dropless layer's rows are tokens x top_k whatever the choice, as the estimate
# has them. ep > 1 is not traced (the all-to-all reads its split sizes back). With
# activation checkpointing a recomputed MoE block keeps its input only; backward
# recomputes it (measured: within 1.5% of the traced tensors, as without).
MOE_MODEL = dict(
    arch="llama", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
    ffn_hidden_size=1536, vocab_size=2048, max_seq_len=1024, tie_embeddings=False,
    moe={"num_experts": 16, "top_k": 4, "expert_ffn_hidden_size": 256, "first_dense_layers": 1},
)  # fmt: skip
MOE_MATRIX = [
    (0, 1, {}, "none"),
    (0, 2, {"shared_experts": 1}, "none"),
    (2, 2, {"router": {"score": "sigmoid", "normalize_top_k": False}, "balance": "bias"}, "none"),
    (3, 2, {}, "none"),
    (0, 1, {"shared_experts": 1}, "full"),
    (3, 2, {"balance": "bias"}, "selective"),
]


@pytest.mark.parametrize(
    "case", MOE_MATRIX, ids=lambda c: f"moe-z{c[0]}-dp{c[1]}-{len(c[2])}-{c[3]}"
)
def test_moe_estimate_within_10_percent_of_the_trace(case):
    import trainlab.models.moe.experts as experts

    real = experts.grouped_mm_available
    zero, dp, moe, recompute = case
    model = {**MOE_MODEL, "moe": {**MOE_MODEL["moe"], **moe}}
    cfg = ExperimentConfig.model_validate(
        {
            "name": "trace",
            "model": model,
            "data": {"seq_len": 1024, "micro_batch_size": 1, "grad_accum_steps": 1},
            "train": {"precision": "bf16"},
            "parallel": {"activation_checkpointing": recompute},
            "resource": {"num_workers": dp, "use_gpu": True},
        }
    )
    layout = Layout(1, 1, dp, zero)
    traced = trace_step(cfg, layout, 1)
    assert experts.grouped_mm_available is real  # the trace's GPU path undone after it
    est = estimate_memory(cfg, layout, 1)
    t, e = traced.memory, est.memory
    assert set(t) == set(e) == {*CATEGORIES, "total"}
    assert abs(e["total"] / t["total"] - 1) <= 0.10, (est.phase, traced.phase)
    tensors = (e["total"] - e["framework"]) / (t["total"] - t["framework"]) - 1
    assert abs(tensors) <= 0.10, (est.phase, traced.phase, e, t)
    assert e["optimizer"] == pytest.approx(t["optimizer"], rel=0.02, abs=2**20)
    if zero < 2:
        assert e["parameters"] == pytest.approx(t["parameters"], rel=0.01)
        assert e["communication"] == pytest.approx(t["communication"], rel=0.01)


def test_an_moe_trace_of_another_target_is_refused_in_one_line():
    from trainlab.errors import UserError

    cfg = ExperimentConfig.model_validate(
        {"name": "trace", "model": MOE_MODEL, "data": {"seq_len": 256, "micro_batch_size": 1,
         "grad_accum_steps": 1}, "train": {"precision": "fp32"}}
    )  # fmt: skip
    with pytest.raises(UserError, match="traced as a GPU bf16 run"):
        trace_step(cfg, Layout(1, 1, 1, 0), 1)
