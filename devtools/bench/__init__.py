"""Benchmarks: every result is a pair measured side by side in the same run.

Each benchmark is a function returning `BenchResult`s; register it in
`BENCHMARKS` ("module:function"). `make bench` (python -m devtools.bench) runs
them all, prints a table and writes bench-results.json at the repo root:
a list of {"name", "value", "unit", "baseline_name", "baseline_value", "ratio"}
plus optional "notes" (where the time goes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class BenchResult:
    name: str
    value: float
    unit: str
    baseline_name: str
    baseline_value: float
    # value / baseline_value; for "lower is better" units the caller says so in notes.
    ratio: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.ratio:
            self.ratio = self.value / self.baseline_value if self.baseline_value else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["notes"]:
            d.pop("notes")
        return d


BENCHMARKS: list[str] = [
    "devtools.bench.plan_bench:bench_plan",
    "devtools.bench.prep_bench:bench_prep",
    "devtools.bench.prep_bench:bench_near_dedup",
    "devtools.bench.loader_bench:bench_loader",
    "devtools.bench.track_bench:bench_tracking",
    "devtools.bench.track_server_bench:bench_tracking_server",
    "devtools.bench.train_bench:bench_train_step_throughput",
    "devtools.bench.train_bench:bench_recovery_seconds",
    "devtools.bench.arch_bench:bench_hf_vs_builtin",
    "devtools.bench.moe_bench:bench_moe_vs_dense",
    "devtools.bench.moe_bench:bench_grouped_vs_loop",
    "devtools.bench.sync_bench:bench_host_syncs_per_step",
    "devtools.bench.ckpt_bench:bench_checkpoint_stall",
    "devtools.bench.elastic_bench:bench_elastic_resume_seconds",
]
