"""Experiment records: the MLflow run of every training run, and reading runs back.

The training loop calls `default_callbacks(cfg)` and drives the result on
rank 0 only. Importing this package does not import mlflow; the store is
`tracking_uri(runs_root)` (the embedded SQLite store in the runs root unless
MLFLOW_TRACKING_URI is set).
"""

from __future__ import annotations

from typing import Any

from trainlab.track.backend import artifact_location, tracking_uri
from trainlab.track.gitinfo import git_env, git_info

__all__ = [
    "artifact_location",
    "close_run",
    "default_callbacks",
    "git_env",
    "git_info",
    "tracking_uri",
]


def default_callbacks(cfg: Any, runs_root: str | None = None) -> list[Any]:
    """The callbacks every training run gets: the MLflow record, then monitoring
    (which writes its signals and alert tags through the MLflow callback).

    `runs_root` pins the store's location; by default it is derived from the run
    directory ({runs_root}/{date}/{name}), which is right wherever rank 0 runs.
    Nothing connects to MLflow before `on_run_start`, so the list pickles.
    """
    from trainlab.monitor import MonitorCallback
    from trainlab.track.mlflow_cb import MlflowCallback

    tracker = MlflowCallback(cfg, runs_root=runs_root)
    return [tracker, MonitorCallback(cfg, tracker=tracker)]


def close_run(
    cfg: Any, run_dir: str, summary: dict[str, Any], runs_root: str | None = None
) -> str | None:
    """Driver side: end the MLflow run of a training run that failed for good
    (its workers could not). The same as calling `on_run_abandoned(run_dir,
    summary)` on fresh `default_callbacks(cfg)`; see `trainlab.track.mlflow_cb.close_run`."""
    from trainlab.track.mlflow_cb import close_run as _close_run

    return _close_run(cfg, run_dir, summary, runs_root)
