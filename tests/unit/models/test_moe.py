"""The MoE family (trainlab.models.moe): the grouped experts compute what the
per-expert loop computes, counts and shapes match the built model, the router's
choices, capacity drops and the injected aux-loss gradient are what they say,
and a bad `model.moe` is one line per problem."""

from __future__ import annotations

import pytest
import torch

from tests.unit.models.common import small
from trainlab.models import arch_of, build_model, num_parameters
from trainlab.models.moe import dispatch
from trainlab.models.moe.experts import GroupedExperts
from trainlab.models.moe.layer import MoE, finish_step, moe_layers

MOE = {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 16}


def moe_model(arch: str = "llama", **moe):
    return small(arch, moe={**MOE, **moe})


def experts_with(counts: list[int], seed: int = 0) -> tuple[GroupedExperts, torch.Tensor]:
    torch.manual_seed(seed)
    ex = GroupedExperts(len(counts), 32, 16).double()  # fp64: only the kernels differ
    ex.init_weights(0.5, 0.5)
    x = torch.randn(sum(counts), 32, dtype=torch.float64, requires_grad=True)
    return ex, x


@pytest.mark.parametrize("counts", [[3, 0, 7, 2], [0, 0, 5, 0], [1, 1, 1, 1]])
def test_grouped_experts_equal_the_per_expert_loop(counts):
    """The padded batched matmul (CPU's path; an empty expert included) gives the
    loop's outputs and the same gradients of every weight and input row."""
    ex, x = experts_with(counts)
    c = torch.tensor(counts)
    ex.use_grouped_mm = False
    got = ex(x, c)
    ref = ex.looped_forward(x, c)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, [x, ex.gate, ex.up, ex.down], g)
    want = torch.autograd.grad(ref, [x, ex.gate, ex.up, ex.down], g)
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("counts", [[3, 0, 7, 2], [0, 0, 5, 0]])
def test_cpu_grouped_gemm_equals_the_per_expert_loop(counts):
    """fp32 on CPU: the grouped GEMM path (torch._grouped_mm in _GroupedMM, its
    backward two more grouped GEMMs) gives the loop's outputs and gradients,
    an empty expert's weight gradient zero."""
    ex, x = experts_with(counts)
    ex, x = ex.float(), x.detach().float().requires_grad_()
    c = torch.tensor(counts)
    calls = []
    original = torch._grouped_mm
    try:
        torch._grouped_mm = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
        got = ex(x, c)
        g = torch.randn_like(got)
        grads = torch.autograd.grad(got, [x, ex.gate, ex.up, ex.down], g)
    finally:
        torch._grouped_mm = original
    assert len(calls) == 9  # 3 forward, 6 backward: the grouped path ran
    ref = ex.looped_forward(x, c)
    want = torch.autograd.grad(ref, [x, ex.gate, ex.up, ex.down], g)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    empty = [e for e, n in enumerate(counts) if n == 0]
    assert grads[1][empty].abs().max() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._grouped_mm runs on CUDA")
def test_grouped_mm_equals_the_loop_on_cuda():
    ex, x = experts_with([5, 0, 17, 8])
    ex, x = ex.float().cuda(), x.detach().float().cuda()
    c = torch.tensor([5, 0, 17, 8], device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = ex(x, c)
    ref = ex.looped_forward(x, c)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "moe",
    [{}, {"shared_experts": 1, "first_dense_layers": 1}, {"every_n_layers": 2, "balance": "bias"}],
)
@pytest.mark.parametrize("arch", ["llama", "llama_qknorm"])
def test_counts_and_shapes_match_the_built_model(arch, moe):
    m = moe_model(arch, **moe)
    model = build_model(m)
    a = arch_of(m)
    assert a.count_params(m).total == num_parameters(model)
    shapes = a.param_shapes(m)
    assert [(s.name, s.shape) for s in shapes] == [
        (n, tuple(p.shape)) for n, p in model.named_parameters()
    ]
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == (
        ["SwiGLU", "MoE"]
        if moe.get("first_dense_layers")
        else ["MoE", "SwiGLU"]
        if moe.get("every_n_layers")
        else ["MoE", "MoE"]
    )
    # active: all but the (E - k) routed experts a token skips, per MoE layer
    per_expert = 3 * 32 * 16
    skipped = kinds.count("MoE") * (4 - 2) * per_expert
    assert a.active_params(m) == num_parameters(model) - skipped
    assert ("layers.0.mlp.router.expert_bias" in model.state_dict()) == (
        moe.get("balance") == "bias"
    )


def test_a_dense_config_builds_and_counts_as_before():
    """No model.moe: the same modules and count as the family always built."""
    m = small("llama")
    assert m.moe is None
    model = build_model(m)
    assert all(type(layer.mlp).__name__ == "SwiGLU" for layer in model.layers)
    assert arch_of(m).active_params(m) == arch_of(m).count_params(m).total


def pinned(layer: MoE, logits: torch.Tensor) -> None:
    """Make the router's logits `logits` [E] for every token (a pinned router)."""
    layer.router.gate = _Pinned(logits)


class _Pinned(torch.nn.Module):
    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(x.shape[0], -1) + 0 * x[:, :1]


def test_layer_equals_a_per_token_reference():
    """out[t] = sum over its top-k experts of weight * expert(x[t]), weights the
    top-k softmax renormalized; the shared expert added."""
    torch.manual_seed(0)
    layer = build_model(moe_model(shared_experts=1)).layers[0].mlp.eval()
    x = torch.randn(2, 5, 32)
    got = layer(x)
    flat = x.reshape(-1, 32)
    probs = torch.softmax(layer.router.gate(flat).float(), -1)
    w, idx = probs.topk(2, -1)
    w = w / w.sum(-1, keepdim=True)
    ex = layer.experts
    want = torch.stack([
        sum(w[t, j] * ex.looped_forward(flat[t : t + 1], torch.eye(4, dtype=torch.long)[idx[t, j]])[0]
            for j in range(2))
        for t in range(flat.shape[0])
    ]) + layer.shared(flat)  # fmt: skip
    torch.testing.assert_close(got.reshape(-1, 32), want, rtol=1e-5, atol=1e-6)


def test_capacity_drops_past_the_limit_and_counts_it():
    """A router pinned on experts 0 and 1: with capacity factor 1 each expert takes
    ceil(1 * 8 tokens * 2 / 4) = 4 rows; 8 - 4 assignments of each are dropped."""
    layer = build_model(moe_model(capacity_factor=1.0)).layers[0].mlp.train()
    pinned(layer, torch.tensor([5.0, 4.0, -5.0, -5.0]))
    x = torch.randn(1, 8, 32)
    out = layer(x)
    stats = layer.take_stats(x.device)
    assert stats[:4].tolist() == [8, 8, 0, 0]
    assert stats[5].item() == 8  # dropped
    # the first 4 tokens (in order) kept both experts, the last 4 none
    assert out[0, 4:].abs().max() == 0 and out[0, :4].abs().min() > 0
    assert dispatch.capacity_of(8, 2, 4, None) is None


def test_aux_loss_gradient_is_the_mean_aux_loss_gradient():
    """The injected gradient (default scale: the mean over the forward's tokens)
    equals autograd's gradient of coef * mean-token aux loss added to the loss."""
    torch.manual_seed(1)
    m = moe_model(aux_loss_coef=0.5)
    layer = build_model(m).layers[0].mlp.train()
    x = torch.randn(3, 4, 32)
    layer(x).sum().backward()
    got = layer.router.gate.weight.grad.clone()
    layer.zero_grad()
    layer.aux_coef = 0.0
    out = layer(x)
    flat = x.reshape(-1, 32)
    probs = torch.softmax(layer.router.gate(flat), -1)
    idx = probs.topk(2, -1).indices
    f = torch.bincount(idx.reshape(-1), minlength=4).float() / (12 * 2)
    aux = 4 * (f * probs.mean(0)).sum() * 0.5 / 2  # coef, averaged over the 2 MoE layers
    (out.sum() + aux).backward()
    torch.testing.assert_close(got, layer.router.gate.weight.grad, rtol=1e-5, atol=1e-7)
    assert not torch.equal(got, layer.router.gate.weight.grad * 0)


def test_bias_moves_once_per_step_from_the_whole_steps_counts():
    """Two forwards (micro batches) then finish_step: one move of +-rate per
    expert, by the sign of (mean - the summed count); counters reset."""
    model = build_model(moe_model(balance="bias", aux_loss_coef=0.0)).train()
    layers = moe_layers(model)
    for layer, logits in zip(layers, ([3.0, 2.0, 0.0, 0.0], [0.0, 0.0, 2.0, 3.0]), strict=True):
        pinned(layer, torch.tensor(logits))
    ids = torch.randint(0, 97, (2, 6))
    model(ids)
    model(ids)
    stats = finish_step(layers, lambda t: t, 0.01, torch.device("cpu"))
    assert stats[0, :4].tolist() == [24, 24, 0, 0] and stats[0, 4] == 24
    assert layers[0].router.expert_bias.tolist() == pytest.approx([-0.01, -0.01, 0.01, 0.01])
    assert layers[1].router.expert_bias.tolist() == pytest.approx([0.01, 0.01, -0.01, -0.01])
    assert layers[0].step_stats is None
    # with the bias the choice changes; the weights stay the scores themselves
    layers[0].router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))
    r = layers[0].router(torch.zeros(1, 32))
    assert sorted(r.experts[0].tolist()) == [0, 3]


def test_eval_forwards_record_nothing():
    model = build_model(moe_model()).eval()
    model(torch.randint(0, 97, (1, 4)))
    assert all(layer.step_stats is None for layer in moe_layers(model))


def test_bad_moe_sections_are_one_line_each_exit_2():
    from tests.unit.cli.test_config_cmds import TINY, trainlab

    out = trainlab(
        "validate", TINY,
        "--set", "model.moe.num_experts=4", "--set", "model.moe.top_k=5",
        "--set", "model.moe.capacity_factor=0.5",
        "--set", "model.moe.expert_ffn_hidden_size=12",
        "--set", "model.moe.first_dense_layers=2",
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert all(ln.startswith("error: ") for ln in lines) and len(lines) == 4
    for want in (
        "model.moe.top_k = 5: must be <= model.moe.num_experts (4)",
        "model.moe.capacity_factor = 0.5: must be >= 1",
        "model.moe.expert_ffn_hidden_size = 12: must be a multiple of 8",
        "model.moe.first_dense_layers = 2: leaves no MoE layer among model.num_layers (2)",
    ):
        assert any(want in ln for ln in lines), (want, lines)


def test_moe_rules_refuse_other_families_and_layouts():
    from pydantic import ValidationError

    from trainlab.config import ExperimentConfig

    with pytest.raises(ValidationError, match="MoE layers are built for the SwiGLU families"):
        ExperimentConfig.model_validate({"name": "x", "model": {"arch": "gpt2", "moe": MOE}})
    with pytest.raises(ValidationError, match=r"parallel.pp = 2: not with model.moe yet"):
        ExperimentConfig.model_validate(
            {"name": "x", "model": {"moe": MOE}, "parallel": {"strategy": "ddp", "pp": 2},
             "resource": {"num_workers": 2}}
        )  # fmt: skip
    # tensor parallelism runs (the MoE layers replicated over tp), with ep on top
    tp = {"name": "x", "model": {"moe": MOE}, "resource": {"num_workers": 4},
          "parallel": {"strategy": "ddp", "tp": 2, "dp": 2, "ep": 2}}  # fmt: skip
    assert ExperimentConfig.model_validate(tp).parallel.tp == 2
    # not under sequence parallelism: one problem, one line
    sp = {**tp, "parallel": {**tp["parallel"], "sequence_parallel": True}}
    with pytest.raises(ValidationError) as refused:
        ExperimentConfig.model_validate(sp)
    lines = [ln for ln in str(refused.value).splitlines() if "parallel." in ln]
    assert len(lines) == 1 and "parallel.sequence_parallel = True: not with model.moe" in lines[0]


def test_a_dense_configs_hash_has_no_moe_key():
    """model.moe absent: the identity (config hash) of before it existed."""
    from trainlab.config import ExperimentConfig
    from trainlab.config.loader import config_hash, identity_dict

    dense = ExperimentConfig.model_validate({"name": "x"})
    assert "moe" not in identity_dict(dense)["model"]
    moe = ExperimentConfig.model_validate({"name": "x", "model": {"moe": MOE}})
    assert identity_dict(moe)["model"]["moe"]["num_experts"] == 4
    assert config_hash(moe) != config_hash(dense)


@pytest.mark.parametrize(
    "parallel, model, error",
    [
        (
            {"ep": 3, "dp": 6},
            {"moe": MOE},
            "parallel.ep = 3: must divide model.moe.num_experts (4)",
        ),
        ({"ep": 4, "dp": 6}, {"moe": MOE}, "parallel.ep = 4: must divide parallel.dp (6)"),
        ({"ep": 2, "dp": 6}, {}, "parallel.ep = 2: needs model.moe"),
    ],
)
def test_ep_rules(parallel, model, error):
    from pydantic import ValidationError

    from trainlab.config import ExperimentConfig

    with pytest.raises(ValidationError, match=error.replace("(", r"\(").replace(")", r"\)")):
        ExperimentConfig.model_validate(
            {"name": "x", "model": model, "parallel": {"strategy": "ddp", **parallel},
             "resource": {"num_workers": 6}}
        )  # fmt: skip
    ok = {"name": "x", "model": {"moe": MOE}, "parallel": {"strategy": "ddp", "ep": 2, "dp": 6},
          "resource": {"num_workers": 6}}  # fmt: skip
    assert ExperimentConfig.model_validate(ok).parallel.ep == 2
    with pytest.raises(ValidationError, match="not with strategy auto or ZeRO-1 yet"):
        ExperimentConfig.model_validate({**ok, "parallel": {"strategy": "ddp", "zero_stage": 1,
                                                            "ep": 2}})  # fmt: skip
    fsdp = {**ok, "parallel": {"strategy": "fsdp", "zero_stage": 3, "ep": 2}}
    assert ExperimentConfig.model_validate(fsdp).parallel.ep == 2
