"""Planner speed: full auto-layout plans per second for a 70B-class config.

Baseline, measured in the same run: validating the same config alone (the
floor any `trainlab plan` pays), so the ratio says what planning adds.

The planner's memory model against a trace of the real training step
(`bench_planner_memory`, run as part of `bench_plan`): the worst error over a
matrix of strategies, precisions, recomputation modes and model sizes, and the
trace's own speed against the analytic estimate's.
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
        ),
        *bench_planner_memory(),
    ]


# --------------------------------------------------------------------------- memory model


LLAMA_7B = {
    "arch": "llama",
    "hidden_size": 4096,
    "num_layers": 32,
    "num_heads": 32,
    "ffn_hidden_size": 11008,
    "vocab_size": 32000,
    "max_seq_len": 4096,
    "tie_embeddings": False,
}
LLAMA_1B = {
    "arch": "llama",
    "hidden_size": 2048,
    "num_layers": 16,
    "num_heads": 32,
    "num_kv_heads": 8,
    "ffn_hidden_size": 8192,
    "vocab_size": 128256,
    "max_seq_len": 4096,
    "tie_embeddings": True,
}
GPT2_SMALL = {
    "arch": "gpt2",
    "hidden_size": 768,
    "num_layers": 12,
    "num_heads": 12,
    "vocab_size": 50257,
    "max_seq_len": 1024,
    "tie_embeddings": True,
}
STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16")
RECOMPUTE = ("none", "selective", "full")


def _memory_cfg(
    model: dict, precision: str, recompute: str, world: int, **data
) -> ExperimentConfig:
    return ExperimentConfig.model_validate(
        {
            "name": "memory",
            "model": model,
            "data": {"seq_len": model["max_seq_len"], "micro_batch_size": 1,
                     "grad_accum_steps": 1, **data},
            "train": {"precision": precision},
            "parallel": {"activation_checkpointing": recompute},
            "resource": {"num_workers": world, "use_gpu": True},
        }
    )  # fmt: skip


def _memory_matrix() -> list[tuple[str, dict, int, str, str, int]]:
    """GPT-2 small: every strategy x precision x recomputation; the Llamas: every
    strategy x recomputation, alternating precisions (a pairwise design); the
    unit tests hold a smaller pairwise one."""
    cases = [
        ("gpt2", GPT2_SMALL, z, p, r, 8) for z in STAGES for p in PRECISIONS for r in RECOMPUTE
    ]
    for name, model in (("llama1b", LLAMA_1B), ("llama7b", LLAMA_7B)):
        for i, (z, r) in enumerate((z, r) for z in STAGES for r in RECOMPUTE):
            if name == "llama7b" and r == "selective":
                continue  # 7B traces take several seconds each
            cases.append((name, model, z, PRECISIONS[i % 2], r, 8))
    return cases


def bench_planner_memory() -> list[BenchResult]:
    """`planner_memory_error_max`: the worst |estimate / traced - 1| of the total per
    device over the matrix (target <= 0.10); the trace's own speed for 7B on 8
    devices and 70B on 64, against the analytic estimate's."""
    from trainlab.plan import Layout, estimate_memory
    from trainlab.train.memtrace import trace_step

    errors: dict[str, float] = {}
    tensor_errors: dict[str, float] = {}
    t0 = time.perf_counter()
    for name, model, zero, precision, recompute, dp in _memory_matrix():
        cfg = _memory_cfg(model, precision, recompute, dp)
        lay = Layout(1, 1, dp, zero)
        traced = trace_step(cfg, lay, 1).memory
        est = estimate_memory(cfg, lay, 1).memory
        key = f"{name}/z{zero}/{precision}/{recompute}/dp{dp}"
        errors[key] = round(est["total"] / traced["total"] - 1, 4)
        tensor_errors[key] = round(
            (est["total"] - est["framework"]) / (traced["total"] - traced["framework"]) - 1, 4
        )
    matrix_seconds = time.perf_counter() - t0
    worst = max(errors, key=lambda k: abs(errors[k]))
    worst_tensors = max(tensor_errors, key=lambda k: abs(tensor_errors[k]))
    results = [
        BenchResult(
            "planner_memory_error_max",
            abs(errors[worst]),
            "fraction",
            "target",
            0.10,
            notes={
                "lower_is_better": True,
                "cases": len(errors),
                "worst": worst,
                "worst_tensors_only": f"{worst_tensors}: {tensor_errors[worst_tensors]}",
                "matrix_seconds": round(matrix_seconds, 1),
                "errors": errors,
            },
        )
    ]
    speed_cases = (
        ("7b_dp8", _memory_cfg(LLAMA_7B, "bf16", "none", 8), Layout(1, 1, 8, 3)),
        (
            "70b_dp64",
            _memory_cfg(LLAMA_70B["model"], "bf16", "selective", 64),
            Layout(1, 1, 64, 3),
        ),
    )
    for name, cfg, lay in speed_cases:
        r = trace_step(cfg, lay, 1)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.5:
            est = estimate_memory(cfg, lay, 1)
            n += 1
        estimate_s = (time.perf_counter() - t0) / n
        results.append(
            BenchResult(
                f"trace_seconds_{name}",
                r.seconds,
                "s",
                "estimate_seconds",
                estimate_s,
                notes={
                    "lower_is_better": True,
                    "phase_seconds": r.phase_seconds,
                    "traced_total_gib": round(r.memory["total"] / 2**30, 2),
                    "estimate_error": round(est.memory["total"] / r.memory["total"] - 1, 4),
                    "peak": f"traced in {r.phase}, estimated at {est.phase}",
                },
            )
        )
    return results
