"""Planner speed: full auto-layout plans per second for a 70B-class config.

Baseline, measured in the same run: validating the same config alone (the
floor any `trainlab plan` pays), so the ratio says what planning adds.
"""

from __future__ import annotations

import time

from devtools.bench import BenchResult
from trainlab.config import ExperimentConfig

LLAMA_70B = {
    "name": "llama70b",
    "model": {
        "arch": "llama",
        "hidden_size": 8192,
        "num_layers": 80,
        "num_heads": 64,
        "num_kv_heads": 8,
        "ffn_hidden_size": 28672,
        "vocab_size": 32000,
        "max_seq_len": 4096,
        "tie_embeddings": False,
    },
    "data": {"seq_len": 4096, "micro_batch_size": 1},
    "train": {"precision": "bf16"},
    "parallel": {"strategy": "auto", "activation_checkpointing": "selective"},
    "resource": {"num_workers": 512, "use_gpu": True, "gpu_memory_gb": 80, "gpus_per_node": 8},
}


def _rate(fn, min_seconds: float = 1.0) -> float:
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_seconds:
        fn()
        n += 1
    return n / elapsed


def bench_plan() -> list[BenchResult]:
    from trainlab.plan import plan

    cfg = ExperimentConfig.model_validate(LLAMA_70B)
    p = plan(cfg)
    plans = _rate(lambda: plan(cfg))
    validations = _rate(lambda: ExperimentConfig.model_validate(LLAMA_70B))
    return [
        BenchResult(
            "plan_per_s_70b",
            plans,
            "plans/s",
            "config_validations_per_s",
            validations,
            notes={"layout": p.parallel, "fits": p.fits, "num_params": p.num_params},
        )
    ]
