"""Tracking cost per logged step: what rank 0 spends in trainlab's callbacks.

Value: logged steps per second that rank 0 gets through `default_callbacks`
(MLflow record with step filtering, monitoring signals, all alert rules) into an
embedded SQLite store: the time the training step waits. Baseline, measured in
the same run on the same store: logging the same metrics with a plain
synchronous `MlflowClient.log_batch` per step, what a straightforward MLflow
callback would make the step wait. The notes give milliseconds per logged step
(paid every `train.log_interval` steps) and when the points were all stored.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from devtools.bench import BenchResult

STEPS = 200


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


def bench_tracking() -> list[BenchResult]:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from trainlab.config import config_hash, load_config
    from trainlab.plan import plan
    from trainlab.track import default_callbacks
    from trainlab.train.callbacks import CallbackList, RunContext

    with tempfile.TemporaryDirectory(prefix="trainlab-bench-track-") as tmp:
        root = Path(tmp) / "runs"
        cfg = load_config(
            Path("trainers/recipes/tiny.yaml"),
            [f"train.runs_root={root}", "tracking.system_metrics=false"],
        )
        run_dir = root / "2026-01-01" / cfg.name
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

        t0 = time.perf_counter()
        for step in range(1, STEPS + 1):
            callbacks.on_step_end(step, _metrics(step))
        trainlab_s = time.perf_counter() - t0
        callbacks.callbacks[0].flush()  # the background writer catching up
        drain_s = time.perf_counter() - t0

        client = MlflowClient(callbacks.callbacks[0].tracking_uri)
        bare = client.create_run(
            client.get_experiment_by_name(cfg.tracking.experiment).experiment_id
        ).info.run_id
        t0 = time.perf_counter()
        for step in range(1, STEPS + 1):
            now = int(time.time() * 1000)
            client.log_batch(
                bare, metrics=[Metric(k, v, now, step) for k, v in _metrics(step).items()]
            )
        bare_s = time.perf_counter() - t0
        callbacks.on_run_end({"name": cfg.name, "status": "completed"})

    return [
        BenchResult(
            "tracking_steps_per_s",
            STEPS / trainlab_s,
            "logged steps/s",
            "mlflow_log_batch_steps_per_s",
            STEPS / bare_s,
            notes={
                "trainlab_ms_per_logged_step": round(1000 * trainlab_s / STEPS, 2),
                "bare_log_batch_ms_per_step": round(1000 * bare_s / STEPS, 2),
                "run_start_s": round(start_s, 2),
                "metrics_per_step": len(_metrics(1)),
                "written_to_store_after_s": round(drain_s, 2),
                "why": "the step only queues points (step filter, monitor signals, 5 alert "
                "rules); a background thread writes them, coalescing queued steps "
                "into one log_batch",
            },
        )
    ]
