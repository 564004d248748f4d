"""The summary of a run ended from outside its processes.

A run's own processes write its run_summary.json when it completes, fails, is
stopped by an alert or interrupted. Two ends leave no process to do so: a job
stopped with `trainlab stop JOB` (trainlab.track.lifecycle) and a run whose
processes vanished (trainlab.track.heartbeat). `write_ended_summary` writes
what they would have, at the newest checkpoint. It touches no MLflow store, so
the store's own opening (trainlab.track.backend) can end lost runs through it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainlab.runstatus import FINAL_STATUSES  # a summary its own processes wrote: kept

TIME_RESOLUTION_S = 1.0  # of an object's modification time in S3


def summary_is_current(run_dir: Path | str) -> bool:
    """run_summary.json is of the run's latest start (not of an earlier one that a
    resume continued): it was written after the latest attempt's record."""
    from trainlab.run.location import RunLocation
    from trainlab.run.records import RunRecords

    loc = RunLocation.of(run_dir)
    written = loc.home.modified("run_summary.json")
    if written is None:
        return False
    started = [float(a.get("time") or 0.0) for a in RunRecords(loc).attempts()]
    # S3 keeps an object's time in whole seconds: a summary written in the second
    # its start began is of that start (a resume takes longer than that).
    return not started or written + TIME_RESOLUTION_S > max(started)


def write_ended_summary(run_dir: str | Path, status: str, reason: str) -> dict[str, Any] | None:
    """Write the summary of the run at `run_dir` (a directory, or a run in object
    storage) ended with `status` ("stopped", "lost") unless its own processes
    already ended it; returns the summary written, or None when there was nothing
    to end (no run there, or a summary of the latest start that says it ended)."""
    from trainlab.run import checkpoints as ckpts
    from trainlab.run.dir import read_run_config
    from trainlab.run.location import RunLocation
    from trainlab.run.records import RunRecords

    loc = RunLocation.of(run_dir)
    cfg = read_run_config(loc)
    if cfg is None:
        return None
    records = RunRecords(loc)
    old = records.read_summary() or {}
    if summary_is_current(run_dir) and old.get("status") in (*FINAL_STATUSES, status):
        return None  # ended by the run, or already marked so
    checkpoints = ckpts.catalog(loc)
    newest = checkpoints.find_resume(require_valid=cfg.train.checkpoint.validate)
    committed = checkpoints.committed()
    best = ckpts.best(committed)
    # val_loss: the latest held-out evaluation on disk (a checkpoint's); best_val_loss:
    # the lowest (keep_best keeps its checkpoint).
    evaluated = [c for c in committed if c.val_loss is not None]
    latest = max(evaluated, key=lambda c: c.step) if evaluated else None
    started = [a.get("time", 0.0) for a in records.attempts()]
    summary: dict[str, Any] = {
        "name": cfg.name,
        "status": status,
        "final_step": records.last_logged_step() or 0,
        "final_loss": None,
        "val_loss": latest.val_loss if latest is not None else None,
        "best_val_loss": best.val_loss if best is not None else None,
        "tokens_seen": (records.last_logged_step() or 0) * cfg.tokens_per_step,
        "restarts": records.restarts(),
        "weights_sha256": None,
        "last_checkpoint": newest.where if newest else None,
        "best_checkpoint": best.where if best else None,
        "wall_seconds": round(time.time() - min(started), 3) if started else None,
        "run_dir": loc.uri,
        "stop_reason": reason,
    }
    records.write_summary(summary)
    return summary
