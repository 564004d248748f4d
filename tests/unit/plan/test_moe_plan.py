"""The planner on an MoE (model.moe): total and active parameters as the built
model has them, FLOPs per token from the active ones, the routed experts'
share of the memory per device."""

from __future__ import annotations

import pytest

from trainlab.config import ExperimentConfig
from trainlab.models import build_model
from trainlab.plan import flops_per_token, plan


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
