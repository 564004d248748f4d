"""Tracking cost per logged step: what rank 0 spends in trainlab's callbacks.

Value: logged steps per second through `default_callbacks` (MLflow record with
step filtering, monitoring signals, all alert rules) into an embedded SQLite
store, timed until every point is in the store (the background writer flushed
and the points read back), not only until the step could go on. Baseline, on
the same store: the same metrics with a plain synchronous
`MlflowClient.log_batch` per step, which has them stored when it returns. The
sides alternate ROUNDS times (the machine is shared) and each is the median;
the notes give the time the training step itself waits (the queueing only).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from devtools.bench import BenchResult

STEPS = 200
ROUNDS = 3


def _metrics(step: int) -> dict[str, float]:
    return {
        "loss": 3.0 + 1.0 / step,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 5000.0,
        "step_time_s": 0.1,
        "data_wait_frac": 0.01,
        "mem_gb": 1.0,
        "mem_peak_gb": 1.2,
        "eta_s": 100.0,
        "ckpt_age_s": 10.0,
        "share/code": 0.5,
        "share/docs": 0.3,
        "share/pkgdocs": 0.2,
    }


def _trainlab_round(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """One run through trainlab's callbacks: seconds the steps waited, seconds until
    the points were stored, and how many loss points the store holds."""
    from mlflow import MlflowClient

    from trainlab.config import config_hash
    from trainlab.plan import plan
    from trainlab.track import default_callbacks
    from trainlab.train.loop.callbacks import CallbackList, RunContext

    run_dir.mkdir(parents=True)
    t0 = time.perf_counter()
    callbacks = CallbackList(default_callbacks(cfg))
    callbacks.on_run_start(
        RunContext(
            cfg=cfg,
            plan=plan(cfg).to_json(),
            run_dir=str(run_dir),
            config_hash=config_hash(cfg),
            dataset_fingerprint="bench",
            manifest_path="",
            start_step=0,
            restarts=0,
        )
    )
    start_s = time.perf_counter() - t0
    tracker = callbacks.callbacks[0]
    t0 = time.perf_counter()
    for step in range(1, STEPS + 1):
        callbacks.on_step_end(step, _metrics(step))
    waited_s = time.perf_counter() - t0
    tracker.flush()  # the background writer catching up
    client = MlflowClient(tracker.tracking_uri)
    stored = len(client.get_metric_history(tracker.run_id, "loss"))
    stored_s = time.perf_counter() - t0
    callbacks.on_run_end({"name": cfg.name, "status": "completed"})
    return {
        "stored_s": stored_s,
        "waited_s": waited_s,
        "start_s": start_s,
        "stored_points": stored,
        "uri": tracker.tracking_uri,
    }


def _bare_round(uri: str, experiment: str) -> float:
    """Seconds for STEPS synchronous log_batch calls (stored when each returns)."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(uri)
    run = client.create_run(client.get_experiment_by_name(experiment).experiment_id)
    t0 = time.perf_counter()
    for step in range(1, STEPS + 1):
        now = int(time.time() * 1000)
        client.log_batch(
            run.info.run_id, metrics=[Metric(k, v, now, step) for k, v in _metrics(step).items()]
        )
    seconds = time.perf_counter() - t0
    client.set_terminated(run.info.run_id)
    return seconds


def bench_tracking() -> list[BenchResult]:
    from trainlab.config import load_config

    ours: list[dict[str, Any]] = []
    bare: list[float] = []
    with tempfile.TemporaryDirectory(prefix="trainlab-bench-track-") as tmp:
        root = Path(tmp) / "runs"
        cfg = load_config(
            Path("trainers/recipes/tiny.yaml"),
            [f"train.runs_root={root}", "tracking.system_metrics=false"],
        )
        for i in range(ROUNDS):  # trainlab, bare, trainlab, bare, ...
            ours.append(_trainlab_round(cfg, root / "2026-01-01" / f"{cfg.name}-{i}"))
            bare.append(_bare_round(ours[0]["uri"], str(cfg.tracking.experiment)))
    stored_s = statistics.median(r["stored_s"] for r in ours)
    waited_s = statistics.median(r["waited_s"] for r in ours)
    bare_s = statistics.median(bare)
    return [
        BenchResult(
            "tracking_steps_per_s",
            STEPS / stored_s,
            "logged steps/s (until stored)",
            "mlflow_log_batch_steps_per_s",
            STEPS / bare_s,
            notes={
                "statistic": f"median of {ROUNDS} interleaved rounds of {STEPS} steps each",
                "trainlab_ms_per_logged_step_until_stored": round(1000 * stored_s / STEPS, 2),
                "trainlab_ms_per_logged_step_the_step_waits": round(1000 * waited_s / STEPS, 2),
                "ratio_step_wait_only (the old headline)": round(
                    (STEPS / waited_s) / (STEPS / bare_s), 2
                ),
                "bare_log_batch_ms_per_step": round(1000 * bare_s / STEPS, 2),
                "loss_points_stored": [r["stored_points"] for r in ours],
                "run_start_s": round(statistics.median(r["start_s"] for r in ours), 2),
                "metrics_per_step": len(_metrics(1)),
                "rounds_s": {
                    "trainlab_until_stored": [round(r["stored_s"], 2) for r in ours],
                    "bare": [round(b, 2) for b in bare],
                },
                "why": "the step only queues points (step filter, monitor signals, alert "
                "rules); a background thread writes them, coalescing queued steps "
                "into one log_batch",
            },
        )
    ]
