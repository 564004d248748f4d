"""Mixture-of-experts benchmarks (model.moe, docs/moe.md), each against a baseline
measured in the same run, fp32 on CPU, one torch thread, the two sides
alternating (which goes first alternating too) after a warm-up; each side's
figure is the median over rounds.

- `moe_vs_dense`: tokens/s of one training step (arch_bench's packed rows,
  chunked cross-entropy, backward, grad clip, AdamW) of an MoE llama (8 experts,
  top 2, expert width 256) against the dense llama with the same active
  parameters (one MLP of width 2 x 256; the router's hidden x 8 per layer
  apart). The ratio is what routing, sorting, padding and combining cost per
  token over the same matmul FLOPs.
- `grouped_vs_loop`: tokens/s of the routed experts alone (forward and backward
  of 2048 token rows x top 2 over 8 experts with a skewed load) through the
  grouped path (torch._grouped_mm: in _GroupedMM on CPU fp32, natively on CUDA bf16)
  against the per-expert Python loop it replaces (GroupedExperts.looped_forward).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from devtools.bench import BenchResult
from devtools.bench.arch_bench import MICRO_BATCH, SEQ_LEN, THREADS, _batch, _steps

DENSE = {
    "arch": "llama",
    "hidden_size": 256,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "ffn_hidden_size": 512,
    "vocab_size": 8192,
    "max_seq_len": 256,
}
MOE = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 256}
WARMUP, STEPS, ROUNDS = 2, 4, 5
# grouped_vs_loop: rows per expert (sum 4096 = 2048 tokens x top 2), skewed.
COUNTS = [1024, 768, 640, 512, 448, 320, 256, 128]
EXPERT_STEPS = 5


def _interleaved(sides: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Seconds of each side per round, alternating which goes first."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        for run in sides.values():
            run()  # warm-up
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        names = list(sides)
        for i in range(ROUNDS):
            for name in names if i % 2 == 0 else names[::-1]:
                seconds[name].append(sides[name]())
    finally:
        torch.set_num_threads(threads)
    return seconds


def _setup(model: dict[str, Any]) -> dict[str, Any]:
    import torch

    from trainlab.config import ExperimentConfig
    from trainlab.models import arch_of, build_model

    cfg = ExperimentConfig.model_validate({"name": "bench-moe", "model": model})
    torch.manual_seed(0)
    built = build_model(cfg.model).train()
    opt = torch.optim.AdamW(built.parameters(), lr=1e-4, weight_decay=0.1)
    arch = arch_of(cfg.model)
    return {"model": built, "opt": opt, "params": arch.count_params(cfg.model).total,
            "active": arch.active_params(cfg.model)}  # fmt: skip


def bench_moe_vs_dense() -> list[BenchResult]:
    batch = _batch()
    moe, dense = _setup({**DENSE, "moe": MOE}), _setup(DENSE)
    for side in (moe, dense):
        _steps(side, batch, WARMUP)
    seconds = _interleaved(
        {"moe": lambda: _steps(moe, batch, STEPS), "dense": lambda: _steps(dense, batch, STEPS)}
    )
    tokens = MICRO_BATCH * SEQ_LEN * STEPS
    rates = {k: [tokens / s for s in v] for k, v in seconds.items()}
    return [
        BenchResult(
            "moe_train_step_throughput",
            statistics.median(rates["moe"]),
            "tokens/s",
            "dense_same_active_train_step_throughput",
            statistics.median(rates["dense"]),
            notes={
                "statistic": f"median over {ROUNDS} interleaved rounds of {STEPS} steps",
                "params": {
                    "moe_total": moe["params"],
                    "moe_active": moe["active"],
                    "dense": dense["params"],
                },  # fmt: skip
                "moe": MOE,
                "shape": {**DENSE, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH},
                "round_tokens_per_s": {k: [round(r) for r in v] for k, v in rates.items()},
                "torch_threads": THREADS,
            },
        )
    ]


def bench_grouped_vs_loop() -> list[BenchResult]:
    import torch

    from trainlab.models.moe.experts import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(len(COUNTS), DENSE["hidden_size"], MOE["expert_ffn_hidden_size"])
    experts.init_weights(0.02, 0.01)
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), DENSE["hidden_size"], requires_grad=True)

    def run(forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        started = time.perf_counter()
        for _ in range(EXPERT_STEPS):
            forward(x, counts).sum().backward()
        return time.perf_counter() - started

    seconds = _interleaved(
        {"grouped": lambda: run(experts), "loop": lambda: run(experts.looped_forward)}
    )
    rows = sum(COUNTS) * EXPERT_STEPS
    rates = {k: [rows / s for s in v] for k, v in seconds.items()}
    return [
        BenchResult(
            "moe_grouped_experts_throughput",
            statistics.median(rates["grouped"]),
            "rows/s",
            "moe_looped_experts_throughput",
            statistics.median(rates["loop"]),
            notes={
                "statistic": f"median over {ROUNDS} interleaved rounds of {EXPERT_STEPS} "
                "forward+backward passes",
                "rows_per_expert": COUNTS,
                "path": "torch._grouped_mm forward and backward (CPU fp32, _GroupedMM)",
                "round_rows_per_s": {k: [round(r) for r in v] for k, v in rates.items()},
                "torch_threads": THREADS,
            },
        )
    ]
