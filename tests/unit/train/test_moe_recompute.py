"""An MoE model (model.moe) under activation checkpointing (trainlab.train.parallel.
recompute): the trainer's step with `full` and `selective` recomputation gives,
in fp32 on CPU, the losses, gradients, router biases (`balance: bias`) and
router statistics and metrics of the step without recomputation. A recomputed
block's forward runs again in backward; its MoE layers must not count their
routing statistics again (trainlab.models.moe.layer.recomputing).

The model has a dense block then two MoE blocks, so `selective` (blocks 0 and 2)
recomputes a dense and an MoE block and keeps one MoE block. torch's checkpoint
stops a recomputation at the last tensor backward needs (early stop): without
shared experts that is before the statistics are taken, so the cases also turn
early stop off (what a compiled checkpoint does) or add shared experts, whose
tensors come after them, to reach them."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from tests.train_helpers import tiny_config
from trainlab.models.moe import layer as moe_layer
from trainlab.models.moe.metrics import router_metrics
from trainlab.train.loop.state import ModelState
from trainlab.train.loop.step import train_step_tensors
from trainlab.train.parallel.distributed import DistEnv

STEPS, MICRO, ROWS, SEQ, VOCAB = 3, 2, 2, 32, 1024
MOE = {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 32, "first_dense_layers": 1}
CASES = {
    # aux-loss-free balancing: the bias moves from the step's counts; shared experts
    "bias-shared": (
        {"balance": "bias", "aux_loss_coef": 0.0, "bias_update_rate": 0.01, "shared_experts": 1},
        True,
    ),
    # the aux loss's injected gradient, a capacity (dropped assignments), sigmoid scores
    "aux-capacity-no-early-stop": (
        {"balance": "aux_loss", "aux_loss_coef": 0.1, "capacity_factor": 1.0,
         "router": {"score": "sigmoid"}},
        False,
    ),
}  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: the CPU grouped GEMM's thread pool on shared cores costs
    milliseconds a call; the figures are the same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batches(step: int) -> list[dict[str, np.ndarray]]:
    """MICRO micro batches of ROWS packed rows, two documents a row."""
    rng = np.random.default_rng(step)
    out = []
    for _ in range(MICRO):
        ids = rng.integers(1, VOCAB, size=(ROWS, SEQ), dtype=np.int64)
        split = SEQ // 2 - 3
        positions = np.concatenate([np.arange(split), np.arange(SEQ - split)])
        documents = (np.arange(SEQ) >= split).astype(np.int32)
        out.append(
            {
                "input_ids": ids,
                "labels": np.roll(ids, -1, axis=1),
                "position_ids": np.tile(positions, (ROWS, 1)),
                "document_ids": np.tile(documents, (ROWS, 1)),
            }
        )
    return out


def name(n: str) -> str:
    return n.replace("_checkpoint_wrapped_module.", "")


def train(tmp_path, moe: dict, recompute: str, early_stop: bool) -> dict[str, list]:
    cfg = tiny_config(
        tmp_path,  # no data is read: the step is given its micro batches
        model={"num_layers": 3, "moe": {**MOE, **moe}},
        data={"micro_batch_size": ROWS, "grad_accum_steps": MICRO},
        parallel={"activation_checkpointing": recompute},
    )
    m = ModelState(cfg, DistEnv())
    device = torch.device("cpu")
    keys = ("loss", "norm", "grads", "bias", "stats", "metrics")
    seen: dict[str, list] = {k: [] for k in keys}

    def step_with_grads(optimizer_step):  # the gradients the optimizer is given
        def wrapped(*args, **kwargs):
            params = m.model.named_parameters()
            seen["grads"].append({name(n): p.grad.clone() for n, p in params})
            return optimizer_step(*args, **kwargs)

        return wrapped

    m.optimizers.only().step = step_with_grads(m.optimizers.only().step)
    stop = contextlib.nullcontext() if early_stop else set_checkpoint_early_stop(False)
    with stop:
        for step in range(STEPS):
            loss, norm = train_step_tensors(m, cfg, step, batches(step), device)
            seen["loss"].append(loss)
            seen["norm"].append(norm)
            biases = [layer.router.expert_bias for layer in m.moe_layers]
            seen["bias"].append([b.clone() for b in biases if b is not None])
            seen["stats"].append(m.moe_stats.clone())
            seen["metrics"].append(router_metrics(m.moe_stats, MOE["num_experts"], MOE["top_k"]))
    assert len(m.moe_layers) == 2
    assert moe_layer._recomputing == 0  # every recomputation left its context
    return seen


def max_abs(a, b) -> float:
    if isinstance(a, dict):
        return max(max_abs(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return max((max_abs(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    if isinstance(a, float):
        return abs(a - b)
    return float((a - b).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("case", list(CASES))
def test_recomputation_trains_as_without_it(case, tmp_path):
    moe, early_stop = CASES[case]
    ref = train(tmp_path, moe, "none", early_stop)
    # every token once per micro batch and MoE layer: the step's tokens, once
    tokens = MICRO * ROWS * SEQ
    for stats in ref["stats"]:
        assert stats[:, MOE["num_experts"]].tolist() == [tokens, tokens]
        assert stats[:, : MOE["num_experts"]].sum(1).tolist() == [tokens * 2, tokens * 2]
    if moe["balance"] == "bias":
        assert any(float(b.abs().sum()) > 0 for b in ref["bias"][-1])
    else:
        assert all(float(s[:, MOE["num_experts"] + 1].sum()) > 0 for s in ref["stats"])
    for mode in ("full", "selective"):
        got = train(tmp_path, moe, mode, early_stop)
        diffs = {k: max_abs(got[k], ref[k]) for k in ref}
        print(f"{case} {mode} vs none: max abs differences {diffs}")
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], msg=f"{mode}: {key} differs")


@pytest.mark.parametrize("mode", ["full", "selective", "auto"])
def test_the_config_rules_take_moe_with_activation_checkpointing(mode, tmp_path):
    cfg = tiny_config(tmp_path, model={"moe": MOE}, parallel={"activation_checkpointing": mode})
    assert cfg.parallel.activation_checkpointing == mode
