"""The planner on an MoE (model.moe): total and active parameters as the built
model has them, FLOPs per token from the active ones, the routed experts'
share of the memory per device."""

from __future__ import annotations

import pytest

from trainlab.config import ExperimentConfig
from trainlab.models import build_model
from trainlab.plan import Layout, flops_per_token, plan


def cfg(**moe) -> ExperimentConfig:
    return ExperimentConfig.model_validate(
        {
            "name": "moe",
            "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 512,
                      "max_seq_len": 64, "ffn_hidden_size": 128,
                      "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 32,
                              "first_dense_layers": 1, **moe}},
            "data": {"seq_len": 64, "micro_batch_size": 2},
            "parallel": {"strategy": "ddp"},
        }
    )  # fmt: skip


def test_plan_counts_total_active_and_the_experts_share():
    c = cfg()
    p = plan(c).to_json()
    model = build_model(c.model)
    params = dict(model.named_parameters())
    experts = sum(t.numel() for n, t in params.items() if ".experts." in n)
    assert p["num_params"] == sum(t.numel() for t in params.values())
    # one token runs 2 of the 8 experts of the one MoE layer
    per_expert = params["layers.1.mlp.experts.gate"][0].numel() * 3
    assert p["num_params_active"] == p["num_params"] - 6 * per_expert
    moe = p["moe"]
    assert moe["experts_params"] == experts and moe["expert_params"] == per_expert
    mem = p["memory_per_device_bytes"]
    share = experts / p["num_params"]
    assert moe["experts_bytes_per_device"]["parameters"] == round(mem["parameters"] * share)
    assert moe["experts_bytes_per_device"]["parameters"] == 4 * experts  # fp32, replicated


def test_flops_follow_the_active_parameters():
    """More experts at the same top_k: more parameters, the same expert FLOPs per
    token (only the router grows: hidden x the extra experts); a larger top_k:
    6 FLOPs per extra active parameter."""
    few, many, wider = cfg(num_experts=4), cfg(num_experts=16), cfg(num_experts=16, top_k=4)
    f = [flops_per_token(c.model, 64) for c in (few, many, wider)]
    assert plan(many).num_params > plan(few).num_params
    assert f[1] - f[0] == 6 * 64 * (16 - 4)  # the router's extra rows
    per_expert = 3 * 64 * 32
    assert f[2] - f[1] == 6 * 2 * per_expert


def test_the_experts_share_per_device_follows_ep():
    one = plan(cfg()).to_json()["moe"]
    c = cfg()
    two = ExperimentConfig.model_validate(
        {**c.model_dump(), "parallel": {"strategy": "ddp", "dp": 2, "ep": 2},
         "resource": {"num_workers": 2}}
    )  # fmt: skip
    split = plan(two).to_json()["moe"]
    assert split["ep"] == 2 and one["ep"] == 1
    assert split["experts_bytes_per_device"]["parameters"] * 2 == pytest.approx(
        one["experts_bytes_per_device"]["parameters"], abs=2
    )


def test_all_to_all_bytes_follow_ep_and_top_k():
    """Nothing crosses ranks at ep 1; at ep 2 half of each row's 4 trips (out and
    back, forward and backward) does, per MoE layer, rows = tokens x top_k."""

    def moe(top_k, ep):
        c = cfg(top_k=top_k)
        dp = {"strategy": "ddp", "dp": 2, "ep": ep}
        two = ExperimentConfig.model_validate(
            {**c.model_dump(), "parallel": dp, "resource": {"num_workers": 2}}
        )
        return plan(two).to_json()["moe"]

    assert moe(2, 1)["all_to_all_bytes_per_step"] == 0
    two = moe(2, 2)["all_to_all_bytes_per_step"]
    rows = 2 * 64 * 2  # micro batch 2 x seq 64 x top_k 2
    assert two == 4 * rows * 64 * 4 * 1 // 2  # fp32, hidden 64, 1 MoE layer, (ep-1)/ep
    assert moe(4, 2)["all_to_all_bytes_per_step"] == 2 * two
    assert moe(4, 2)["dispatch_bytes_per_layer"] == 2 * moe(2, 2)["dispatch_bytes_per_layer"]


def test_strategy_auto_chooses_ep_when_the_experts_dominate():
    """On 8 GPUs of a node an MoE whose routed experts are most of its parameters
    gets the largest ep dividing dp and num_experts; resolve_layout makes it the
    run's parallel.ep. A small expert share, or CPUs, keep ep 1."""
    from trainlab.plan import resolve_layout

    def auto(gpu: bool, **moe):
        c = cfg(**moe)
        raw = c.model_dump()
        raw["parallel"] = {"strategy": "auto"}
        raw["resource"] = {"num_workers": 8, "use_gpu": gpu, "gpus_per_node": 8}
        return ExperimentConfig.model_validate(raw)

    many = auto(True, num_experts=16, expert_ffn_hidden_size=256, first_dense_layers=0)
    p = plan(many)
    share = p.to_json()["moe"]["experts_share_of_params"]
    assert share >= 0.5 and p.parallel["ep"] == 8 and p.parallel["zero_stage"] != 1
    assert any(n.startswith("parallel.ep 8:") for n in p.notes)
    assert resolve_layout(many, p).parallel.ep == 8
    few = auto(True, num_experts=2, top_k=1, expert_ffn_hidden_size=8)
    assert plan(few).to_json()["moe"]["experts_share_of_params"] < 0.5
    assert plan(few).parallel["ep"] == 1
    assert plan(auto(False, num_experts=16, expert_ffn_hidden_size=256)).parallel["ep"] == 1


# --------------------------------------------------------------------------- memory at ep


def wide(ep=None, strategy="ddp", zero=0, gpu_memory_gb=80.0, **moe) -> ExperimentConfig:
    """An MoE whose routed experts are most of its parameters (83%), on 2 GPUs of a
    node: 3 MoE layers of 8 experts of width 1024 after a dense one."""
    parallel = {"strategy": strategy, "zero_stage": zero}
    if ep is not None:
        parallel["ep"] = ep
    if strategy != "auto":
        parallel["dp"] = 2
    return ExperimentConfig.model_validate(
        {
            "name": "moe",
            "model": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "vocab_size": 2048,
                      "max_seq_len": 512, "ffn_hidden_size": 1536,
                      "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 1024,
                              "first_dense_layers": 1, **moe}},
            "data": {"seq_len": 512, "micro_batch_size": 2},
            "train": {"precision": "bf16"},
            "parallel": parallel,
            "resource": {"num_workers": 2, "use_gpu": True, "gpus_per_node": 2,
                         "gpu_memory_gb": gpu_memory_gb},
        }
    )  # fmt: skip


def test_memory_per_device_drops_by_the_experts_state_at_ep():
    """DDP at ep=2 (trainlab.train.parallel.expert): each device holds 4 of the 8
    routed experts (fp32 weights and gradients, AdamW's two moments: half), and
    DDP's gradient buckets leave them out (all of them: ep all-reduces them in
    place). memory_per_device_bytes, what `fits` reads, drops by that much."""
    one, two = plan(wide(ep=1)), plan(wide(ep=2))
    assert one.parallel["ep"] == 1 and two.parallel["ep"] == 2
    routed = one.moe["experts_params"]
    m1, m2 = one.memory_per_device_bytes, two.memory_per_device_bytes
    assert m1["parameters"] - m2["parameters"] == 4 * routed / 2
    assert m1["communication"] - m2["communication"] == 4 * routed
    s1, s2 = one.moe["experts_bytes_per_device"], two.moe["experts_bytes_per_device"]
    assert s1 == {"parameters": 4 * routed, "gradients": 4 * routed,
                  "optimizer": 8 * routed + 4 * 9, "communication": 4 * routed}  # fmt: skip
    assert s2 == {"parameters": 2 * routed, "gradients": 2 * routed,
                  "optimizer": 4 * routed + 4 * 9, "communication": 0}  # fmt: skip
    share = sum(s1.values()) - sum(s2.values())  # 12 bytes per routed parameter
    assert m1["total"] - m2["total"] == pytest.approx(share, rel=0.1)


def test_ep_makes_an_moe_fit():
    """2 GiB GPUs: at ep=1 the experts' state does not fit beside the rest; at
    ep=2 it does. As configured (strategy ddp) the plan says to raise ep; under
    strategy auto the planner picks ep=2 itself (the experts are most of the
    parameters) and keeps ZeRO-0, where it needed ZeRO-1 before."""
    small = {"gpu_memory_gb": 2.0}
    ddp = plan(wide(ep=1, **small))
    assert not ddp.fits
    assert any(n.startswith("to fit now") and "parallel.ep: 2" in n for n in ddp.notes)
    assert plan(wide(ep=2, **small)).fits
    pinned = plan(wide(ep=1, strategy="auto", zero=None, **small))
    assert pinned.fits and pinned.parallel["zero_stage"] == 1 and pinned.parallel["ep"] == 1
    chosen = plan(wide(strategy="auto", zero=None, **small))
    assert chosen.fits and chosen.parallel == {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 0, "ep": 2}
    assert chosen.memory_per_device_bytes["total"] <= chosen.usable_memory_bytes
    zero0 = plan(wide(ep=1, strategy="auto", zero=0, **small))
    assert not zero0.fits  # tp=2 saves the dense part only: the MoE layers stay whole
    assert any("parallel.ep: null" in n for n in zero0.notes)


def test_strategy_auto_proposes_tp_for_an_moe_whose_attention_needs_it():
    """Eager attention at 4096 tokens: its scores are most of the activations, which
    ZeRO does not shard and tensor parallelism splits by heads. On 2 GPUs of 8 GiB
    no data-parallel layout holds it (FSDP: 9.3 GiB per device); tp=2 does (6.6
    GiB), with the MoE layers replicated over tp, and the run's config is valid."""
    from trainlab.plan import resolve_layout

    c = ExperimentConfig.model_validate(
        {
            "name": "moe",
            "model": {"hidden_size": 1024, "num_layers": 4, "num_heads": 16, "vocab_size": 32000,
                      "max_seq_len": 4096, "ffn_hidden_size": 2816, "attention": "eager",
                      "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 512,
                              "first_dense_layers": 1}},
            "data": {"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 8},
            "train": {"precision": "bf16"},
            "parallel": {"strategy": "auto"},
            "resource": {"num_workers": 2, "use_gpu": True, "gpus_per_node": 2,
                         "gpu_memory_gb": 8.0},
        }
    )  # fmt: skip
    p = plan(c)
    assert p.fits and p.parallel == {"tp": 2, "pp": 1, "dp": 1, "zero_stage": 0, "ep": 1}
    run_cfg = resolve_layout(c, p)
    assert ExperimentConfig.model_validate(run_cfg.model_dump()).parallel.tp == 2


def test_ep_at_tp_stays_within_a_node():
    """An ep group is the dp ranks of one tp coordinate (trainlab.train.parallel.
    expert): at tp=2 on 4 GPUs of a node, 2 of them; on nodes of 2 GPUs each dp
    rank of a tp coordinate is on another node, and strategy auto keeps ep 1."""
    from trainlab.plan.planner import choose_ep

    def four(gpus_per_node: int) -> ExperimentConfig:
        raw = cfg(num_experts=16, expert_ffn_hidden_size=256, first_dense_layers=0).model_dump()
        raw["parallel"] = {"strategy": "auto"}
        raw["resource"] = {"num_workers": 4, "use_gpu": True, "gpus_per_node": gpus_per_node}
        return ExperimentConfig.model_validate(raw)

    assert choose_ep(four(4), Layout(2, 1, 2, 0))[0] == 2
    assert choose_ep(four(2), Layout(2, 1, 2, 0))[0] == 1
    assert choose_ep(four(4), Layout(1, 1, 4, 0))[0] == 4


def test_fsdp_leaves_the_experts_whole_at_ep():
    """FSDP is told to ignore the experts at ep > 1: each device holds its
    num_experts/ep of them unsharded (fp32 weights, gradients and state), none in
    a block's all-gather. At dp = ep = 2 that is the same state per device as
    ZeRO-3's shards at ep=1."""
    routed = plan(wide(ep=1)).moe["experts_params"]
    for zero in (2, 3):
        one = plan(wide(ep=1, strategy="fsdp", zero=zero)).moe["experts_bytes_per_device"]
        two = plan(wide(ep=2, strategy="fsdp", zero=zero)).moe["experts_bytes_per_device"]
        assert one["parameters"] == two["parameters"] == 4 * routed / 2
        assert one["communication"] == two["communication"] == 0


def test_dispatch_buffers_are_in_the_activations():
    """Each (token, expert) row an MoE layer keeps for backward, per the hand
    count of trainlab.plan.memory._moe_layer_bytes (DDP bf16: autocast): the
    sorted rows (2 x hidden) and the weighted rows (2 x hidden) in bf16, the
    experts' output in fp32 (4 x hidden), four expert-wide tensors (4 x 2 x
    width), its weight and two int64 indices (20); and per token the chosen
    weights and ids (12 x top_k)."""
    from trainlab.plan.memory import estimate_memory

    lay = Layout(1, 1, 2, 0)
    h, f, tokens, layers = 512, 1024, 2 * 512, 3
    per_row = 2 * h + 2 * h + 4 * h + 4 * 2 * f + 20
    top = {k: estimate_memory(wide(ep=1, top_k=k), lay, 2) for k in (2, 4)}
    grown = (
        top[4].breakdowns["forward"]["activations"] - top[2].breakdowns["forward"]["activations"]
    )
    assert grown == layers * tokens * 2 * (per_row + 12)


def test_a_dense_config_ignores_ep():
    from trainlab.plan.memory import estimate_memory

    c = cfg()
    dense = c.model_copy(update={"model": c.model.model_copy(update={"moe": None})})
    lay = Layout(1, 1, 2, 0)
    assert (
        estimate_memory(dense, lay, 2, ep=2).breakdowns == estimate_memory(dense, lay, 2).breakdowns
    )


# The dense estimate before expert parallelism entered the memory model (issue 39):
# per-device totals in bytes, pinned; an MoE-only change must leave them as they are.
DENSE_TOTALS = {
    ("llama7b", (1, 1, 8, 0)): 155_284_751_500,
    ("llama7b", (1, 1, 8, 1)): 108_180_586_604,
    ("llama7b", (1, 1, 8, 3)): 39_785_524_364,
    ("llama7b", (2, 1, 4, 0)): 83_896_616_076,
    ("gpt2", (1, 1, 8, 0)): 4_209_475_856,
    ("gpt2", (1, 1, 8, 1)): 3_522_735_620,
    ("gpt2", (1, 1, 8, 3)): 2_199_075_344,
    ("gpt2", (2, 1, 4, 0)): 2_752_157_200,
}


@pytest.mark.parametrize("key", sorted(DENSE_TOTALS), ids=lambda k: f"{k[0]}-{k[1]}")
def test_dense_estimates_are_unchanged(key):
    from trainlab.plan.memory import estimate_memory

    models = {
        "llama7b": ({"arch": "llama", "hidden_size": 4096, "num_layers": 32, "num_heads": 32,
                     "ffn_hidden_size": 11008, "vocab_size": 32000, "max_seq_len": 4096,
                     "tie_embeddings": False}, 4096),
        "gpt2": ({"arch": "gpt2", "hidden_size": 768, "num_layers": 12, "num_heads": 12,
                  "vocab_size": 50257, "max_seq_len": 1024, "tie_embeddings": True}, 1024),
    }  # fmt: skip
    name, layout = key
    model, seq = models[name]
    c = ExperimentConfig.model_validate(
        {
            "name": "m",
            "model": model,
            "data": {"seq_len": seq, "micro_batch_size": 1, "grad_accum_steps": 1},
            "train": {"precision": "bf16"},
            "resource": {"num_workers": 8, "use_gpu": True},
        }
    )
    assert int(estimate_memory(c, Layout(*layout), 1).memory["total"]) == DENSE_TOTALS[key]


def test_tp_leaves_the_moe_layers_whole():
    """Tensor parallelism splits attention, the dense MLPs and the embeddings over
    tp; an MoE layer's MLP (router, experts) is replicated over the tp ranks
    (trainlab.train.parallel.tensor): per device, its parameters count whole."""
    from trainlab.plan.memory import experts_state_bytes, memory_breakdown

    c = cfg()
    params = dict(build_model(c.model).named_parameters())
    moe_mlp = sum(t.numel() for n, t in params.items() if n.startswith("layers.1.mlp."))
    rest = sum(t.numel() for t in params.values()) - moe_mlp
    for ep in (1, 2):
        mem = memory_breakdown(c, Layout(2, 1, 2, 0), 2, ep)
        assert mem["parameters"] == 4 * (moe_mlp - (ep - 1) / ep * 3 * 8 * 64 * 32 + rest / 2)
        at_tp1 = experts_state_bytes(c, Layout(1, 1, 2, 0), ep)
        assert experts_state_bytes(c, Layout(2, 1, 2, 0), ep)["parameters"] == at_tp1["parameters"]
