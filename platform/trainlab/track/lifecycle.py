"""Ending a run's records from outside its processes.

A run's own processes end its records (run_summary.json, the MLflow run) when
it completes, fails, is stopped by an alert or interrupted. Two ends leave no
process to do so: a job stopped with `trainlab stop JOB` (Ray kills its driver
and workers) and a run whose processes vanished (a lost machine, `kill -9`).
`end_run` writes what they would have: the summary with the given status at the
newest checkpoint, and the MLflow run ended with the matching status (stopped
-> KILLED, lost -> FAILED) and its `status` tag.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainlab.track import heartbeat

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

log = logging.getLogger(__name__)

# What a summary says when the run's own processes ended it: not overwritten.
FINAL_STATUSES = frozenset({"completed", "failed", "stopped", "stopped_by_alert", "interrupted"})


def summary_is_current(run_dir: Path) -> bool:
    """run_summary.json is of the run's latest start (not of an earlier one that a
    resume continued): it is newer than the latest attempt."""
    summary = run_dir / "run_summary.json"
    attempts = run_dir / "logs" / "attempts.jsonl"
    if not summary.is_file():
        return False
    return not attempts.is_file() or summary.stat().st_mtime >= attempts.stat().st_mtime


def end_run(run_dir: str | Path, status: str, reason: str) -> dict[str, Any] | None:
    """Mark the run in `run_dir` ended with `status` ("stopped", "lost") unless its
    own processes already ended it; returns the summary written, or None when
    there was nothing to end (no run directory, or a summary of the latest start
    that says it ended)."""
    from trainlab.config import load_config
    from trainlab.track.mlflow_cb import close_run
    from trainlab.train import checkpoint as ck
    from trainlab.train.records import RunRecords

    rd = Path(run_dir)
    if not (rd / "config.yaml").is_file():
        return None
    records = RunRecords(rd)
    old = records.read_summary() or {}
    if summary_is_current(rd) and old.get("status") in FINAL_STATUSES:
        return None
    cfg = load_config(str(rd / "config.yaml"))
    newest = ck.find_resume(rd / "checkpoints", require_valid=cfg.train.checkpoint.validate)
    best = ck.best(ck.committed(rd / "checkpoints"))
    started = [a.get("time", 0.0) for a in records.attempts()]
    summary: dict[str, Any] = {
        "name": cfg.name,
        "status": status,
        "final_step": records.last_logged_step() or 0,
        "final_loss": None,
        "val_loss": best.val_loss if best is not None else None,
        "tokens_seen": (records.last_logged_step() or 0) * cfg.tokens_per_step,
        "restarts": records.restarts(),
        "weights_sha256": None,
        "last_checkpoint": str(newest.path) if newest else None,
        "best_checkpoint": str(best.path) if best else None,
        "wall_seconds": round(time.time() - min(started), 3) if started else None,
        "run_dir": str(rd),
        "stop_reason": reason,
    }
    records.write_summary(summary)
    close_run(cfg, str(rd), summary)
    return summary


def run_dir_of_job(metadata: dict[str, Any] | None) -> str | None:
    """The run directory a `trainlab submit` job trains in (its job metadata)."""
    value = (metadata or {}).get("trainlab_run_dir")
    return str(value) if value else None


def mark_lost(client: MlflowClient, run: Run) -> dict[str, Any] | None:
    """End a lost run's records: its run directory's summary (when this machine
    sees it) and the MLflow run (FAILED, status tag `lost`)."""
    last = time.localtime(float(run.data.tags[heartbeat.HEARTBEAT_TAG]))
    reason = f"lost: no heartbeat since {time.strftime('%Y-%m-%d %H:%M:%S', last)}"
    summary = None
    run_dir = run.data.tags.get("run_dir")
    if run_dir:
        try:
            summary = end_run(run_dir, "lost", reason)
        except (OSError, ValueError) as e:
            log.warning("could not mark %s lost: %s", run_dir, e)
    # Whatever the run directory said, the store must stop calling it running.
    client.set_tag(run.info.run_id, "status", "lost")
    client.set_terminated(run.info.run_id, "FAILED")
    return summary
