"""Ending a run's records from outside its processes.

A run's own processes end its records (run_summary.json, the MLflow run) when
it completes, fails, is stopped by an alert or interrupted. Two ends leave no
process to do so: a job stopped with `trainlab stop JOB` (Ray kills its driver
and workers) and a run whose processes vanished (a lost machine, `kill -9`).
`end_run` writes what they would have: the summary with the given status at the
newest checkpoint (trainlab.track.ended), and the MLflow run closed with its
curves and the matching status (stopped -> KILLED) and `status` tag. Lost runs
are ended by whichever trainlab command next opens the store
(trainlab.track.heartbeat.correct_lost, called by trainlab.track.backend.client_for).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainlab.track.ended import write_ended_summary


def end_run(run_dir: str | Path, status: str, reason: str) -> dict[str, Any] | None:
    """Mark the run in `run_dir` ended with `status` (e.g. "stopped") unless its
    own processes already ended it; returns the summary written, or None when
    there was nothing to end (no run directory, or a summary of the latest start
    that says it ended)."""
    from trainlab.run.dir import read_run_config
    from trainlab.track.mlflow_cb import close_run

    summary = write_ended_summary(run_dir, status, reason)
    if summary is not None:  # the run has a config (write_ended_summary read it)
        close_run(read_run_config(run_dir), str(run_dir), summary)
    return summary


def run_dir_of_job(metadata: dict[str, Any] | None) -> str | None:
    """The run directory a `trainlab submit` job trains in (its job metadata)."""
    value = (metadata or {}).get("trainlab_run_dir")
    return str(value) if value else None
