"""`elastic_resume_seconds`: from a lost node to the first step after it, an elastic
run continuing smaller vs today's job-retry path, on one local multi-node cluster.

The cluster: `trainlab cluster up --num-cpus 3 --worker-nodes 2 --worker-cpus 3`
(three raylets on this machine, 3 logical CPUs each; every training worker takes
2, so each node hosts one). Both sides run the tiny recipe through `trainlab
submit --follow` (the driver is a job on the head node) and lose a worker's node
at step KILL_AT (`train.chaos.kill_node_at_steps`: its raylet is SIGKILLed):

- elastic: `resource.num_workers: {min: 2, max: 3}` starts at 3 and continues at
  2 in the same Ray Train run (trainlab.train.driver.elastic);
- job retry: a fixed 2 workers with `train.max_failures: 0` and
  `resource.job_retries: 1`: the driver exits 75, the retry (a new Ray job)
  avoids the lost node and resumes from the newest checkpoint.

Both are measured the same way from the run's records: from the chaos marker's
time (written by the lost rank right before the kill) to the first completed
step of the next attempt (logs/attempts.jsonl). After each side `trainlab
cluster add-node` brings the cluster back to three raylets. The sides alternate
(which goes first alternating too); each is the median of SAMPLES.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from devtools.bench import BenchResult

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SAMPLES = 2
STEPS, KILL_AT = 12, 5
TIMEOUT_S = 900


def _trainlab(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(BIN / "trainlab"), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=REPO,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"trainlab {args[0]} {args[1]}: {proc.stderr[-2000:]}")
    return proc


def _sets(dataset: Path, runs: Path, name: str, elastic: bool) -> list[str]:
    items = [
        f"name={name}",
        f"data.path={dataset}",
        "data.mix={code: 0.6, docs: 0.4}",
        "data.micro_batch_size=2",
        "data.global_batch_size=12",
        "model.vocab_size=2048",
        "resource.cpus_per_worker=2",
        f"train.runs_root={runs}",
        f"train.total_steps={STEPS}",
        "train.warmup_steps=2",
        "train.log_interval=1",
        "train.eval_interval=100",
        "train.checkpoint.every_steps=2",
        f"train.chaos.kill_node_at_steps=[{KILL_AT}]",
        "tracking.system_metrics=false",
    ]
    if elastic:
        items += ["resource.num_workers.min=2", "resource.num_workers.max=3"]
    else:
        items += ["resource.num_workers=2", "train.max_failures=0", "resource.job_retries=1"]
    return [a for item in items for a in ("--set", item)]


def resume_seconds(run_dir: Path) -> dict[str, Any]:
    """From the lost node's chaos marker to the first step of the attempt after it."""
    from trainlab.run.records import RunRecords

    records = RunRecords(run_dir)
    (marker,) = sorted((run_dir / "logs").glob("chaos-node-step-*.json"))
    lost = json.loads(marker.read_text())
    after = [r for r in records.first_steps() if float(r["time"]) > float(lost["time"])]
    summary = json.loads((run_dir / "run_summary.json").read_text())
    return {
        "seconds": float(after[0]["time"]) - float(lost["time"]),
        "resumed_at_step": after[0]["first_step"] - 1,
        "world_sizes": [a["world_size"] for a in records.attempts()],
        "status": summary["status"],
    }


def _side(env: dict[str, str], dataset: Path, root: Path, dashboard: str, name: str,
          elastic: bool) -> dict[str, Any]:  # fmt: skip
    args = ["submit", "trainers/recipes/tiny.yaml", *_sets(dataset, root / name, name, elastic)]
    out = _trainlab(env, *args, "--address", dashboard, "--follow", "--json")
    job = json.loads(out.stdout.strip().splitlines()[-1])
    if job.get("status") != "SUCCEEDED":
        raise RuntimeError(f"{name}: the job ended {job.get('status')}")
    got = resume_seconds(Path(job["run_dir"]))
    if got["status"] != "completed":
        raise RuntimeError(f"{name}: the run ended {got['status']}")
    _trainlab(env, "cluster", "add-node", "--num-cpus=3", "--json")  # three raylets again
    return got


def bench_elastic_resume_seconds() -> list[BenchResult]:
    from devtools.datasets import write_stdlib_dataset

    elastic: list[dict[str, Any]] = []
    retry: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="trainlab-bench-elastic-") as tmp:
        root = Path(tmp)
        env = {**os.environ, "TRAINLAB_HOME": str(root / "home")}
        for var in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
            env.pop(var, None)
        dataset = root / "prepared"
        write_stdlib_dataset(dataset, code_docs=60, prose_docs=200, vocab_size=2048)
        up = _trainlab(
            env, "cluster", "up", "--num-cpus=3", "--worker-nodes=2", "--worker-cpus=3", "--json"
        )
        dashboard = json.loads(up.stdout.strip().splitlines()[-1])["dashboard_url"]
        try:
            for i in range(SAMPLES):
                sides = [
                    lambda i=i: elastic.append(
                        _side(env, dataset, root, dashboard, f"elastic-{i}", True)
                    ),
                    lambda i=i: retry.append(
                        _side(env, dataset, root, dashboard, f"retry-{i}", False)
                    ),
                ]
                for side in sides if i % 2 == 0 else sides[::-1]:
                    side()
        finally:
            subprocess.run([str(BIN / "trainlab"), "cluster", "down"], env=env, cwd=REPO,
                           capture_output=True, timeout=300)  # fmt: skip
    return [
        BenchResult(
            "elastic_resume_seconds",
            statistics.median(e["seconds"] for e in elastic),
            "s",
            "job_retry_resume_seconds",
            statistics.median(r["seconds"] for r in retry),
            notes={
                "lower_is_better": True,
                "statistic": f"median of {SAMPLES} interleaved samples per side",
                "samples_s": {
                    "elastic": [round(e["seconds"], 1) for e in elastic],
                    "job_retry": [round(r["seconds"], 1) for r in retry],
                },
                "world_sizes": {
                    "elastic": [e["world_sizes"] for e in elastic],
                    "job_retry": [r["world_sizes"] for r in retry],
                },
                "same_for_both": "three 3-CPU raylets, 2 CPUs per worker, the tiny recipe, "
                f"node lost at step {KILL_AT} (raylet SIGKILL), checkpoints every 2 steps; "
                "from the chaos marker to the next attempt's first step",
                "elastic": "num_workers {min: 2, max: 3}: Ray Train restarts the group at 2 "
                "(trainlab's policy waits for the GCS to drop the lost node)",
                "baseline": "fixed 2 workers, max_failures 0, job_retries 1: a new driver "
                "job avoids the lost node and resumes",
            },
        )
    ]
