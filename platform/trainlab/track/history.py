"""Moving a project's past into a team's server: `trainlab tracking import`.

Copies every (not deleted) run of an embedded store (`sqlite:///.../mlflow.db`)
into another tracking store, usually a server (trainlab.track.server): its
experiment (by name, created when missing, with its tags), run name, start and
end times, status, tags, params, every metric point (key, value, step,
timestamp: the whole history, not the latest value) and its artifacts.

Idempotent: each copied run carries the tag `IMPORT_TAG` (the source run's id;
MLflow run ids are random UUIDs) and, once everything of it is in,
`IMPORT_DONE_TAG`. A run found with both is skipped; one found without the
second (a copy cut short) is completed in place: params and tags are set to
the same values again, and metric points the store already has are kept once
(the store's key is the whole point).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainlab.errors import UserError
from trainlab.redact import redact

IMPORT_TAG = "trainlab_import_source"
IMPORT_DONE_TAG = "trainlab_import_complete"
METRICS_PER_BATCH = 1000
PARAMS_PER_BATCH = 100
TAGS_PER_BATCH = 100
_TERMINAL = ("FINISHED", "FAILED", "KILLED")


def source_uri(source: str) -> str:
    """The embedded store named by `source` (sqlite:///path, the .db file, or a
    runs root holding mlflow.db); UserError when there is none."""
    from trainlab.track.backend import DB_FILE

    if source.startswith("sqlite:///"):
        path = Path(source.removeprefix("sqlite:///"))
    elif "://" in source:
        raise UserError(
            f"--from {redact(source)}: not an embedded store (sqlite:///.../mlflow.db, the "
            "file, or a runs root)"
        )
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            path = path / DB_FILE
    if not path.is_file():
        raise UserError(f"--from {source}: no MLflow store there ({path} does not exist)")
    return f"sqlite:///{path.resolve()}"


def _all_runs(client: Any, exp_id: str) -> list[Any]:
    runs, token = [], None
    while True:
        page = client.search_runs(
            [exp_id], max_results=1000, page_token=token, order_by=["attributes.start_time ASC"]
        )
        runs += list(page)
        token = page.token
        if not token:
            return runs


def copy_history(
    src: str, dest: str, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Copy the runs of store `src` into store `dest`; returns
    {"copied": n, "skipped": m, "runs": {source run id: destination run id}, ...}."""
    from mlflow import MlflowClient

    from trainlab.track.experiments import get_or_create_experiment

    say = progress or (lambda _line: None)
    # MLflow's own output (a link per ended run on stdout, download progress bars):
    # the command says what it copied itself.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    source, target = MlflowClient(tracking_uri=src), MlflowClient(tracking_uri=dest)
    copied, skipped, mapping = 0, 0, {}
    for exp in source.search_experiments():
        runs = _all_runs(source, exp.experiment_id)
        if not runs:
            continue
        exp_id = get_or_create_experiment(target, exp.name, None)
        for key, value in exp.tags.items():
            if not key.startswith("mlflow.") or key == "mlflow.note.content":
                target.set_experiment_tag(exp_id, key, value)
        for run in runs:
            found = target.search_runs(
                [exp_id],
                filter_string=f"tags.{IMPORT_TAG} = '{run.info.run_id}'",
                max_results=1,
            )
            if found and found[0].data.tags.get(IMPORT_DONE_TAG) == "true":
                skipped += 1
                mapping[run.info.run_id] = found[0].info.run_id
                continue
            new_id = _copy_run(source, target, exp_id, run, found[0] if found else None)
            mapping[run.info.run_id] = new_id
            copied += 1
            say(f"  {exp.name}/{run.info.run_name}: copied ({run.info.run_id[:8]} -> {new_id[:8]})")
    return {"copied": copied, "skipped": skipped, "from": src, "to": redact(dest), "runs": mapping}


def _copy_run(source: Any, target: Any, exp_id: str, run: Any, partial: Any) -> str:
    from mlflow.entities import Metric, Param, RunTag

    info = run.info
    tags = {k: v for k, v in run.data.tags.items() if k != IMPORT_DONE_TAG}
    tags[IMPORT_TAG] = info.run_id
    if partial is None:
        new = target.create_run(
            exp_id, start_time=info.start_time, tags=tags, run_name=info.run_name
        )
        run_id = new.info.run_id
    else:
        run_id = partial.info.run_id
        target.update_run(run_id, status="RUNNING")
    items = [RunTag(k, v) for k, v in tags.items()]
    for i in range(0, len(items), TAGS_PER_BATCH):
        target.log_batch(run_id, tags=items[i : i + TAGS_PER_BATCH])
    params = [Param(k, v) for k, v in run.data.params.items()]
    for i in range(0, len(params), PARAMS_PER_BATCH):
        target.log_batch(run_id, params=params[i : i + PARAMS_PER_BATCH])
    for key in run.data.metrics:
        points = [
            Metric(m.key, m.value, m.timestamp, m.step)
            for m in source.get_metric_history(info.run_id, key)
        ]
        for i in range(0, len(points), METRICS_PER_BATCH):
            target.log_batch(run_id, metrics=points[i : i + METRICS_PER_BATCH])
    _copy_artifacts(source, target, info.run_id, run_id)
    if info.status in _TERMINAL:
        target.set_terminated(run_id, info.status, end_time=info.end_time)
    else:
        target.update_run(run_id, status=info.status)
    target.set_tag(run_id, IMPORT_DONE_TAG, "true")
    return run_id


def _copy_artifacts(source: Any, target: Any, src_id: str, dest_id: str) -> None:
    if not source.list_artifacts(src_id):
        return
    with tempfile.TemporaryDirectory(prefix="trainlab-import-") as tmp:
        local = source.download_artifacts(src_id, "", tmp)
        for entry in sorted(os.listdir(local)):
            path = os.path.join(local, entry)
            if os.path.isdir(path):
                target.log_artifacts(dest_id, path, entry)
            else:
                target.log_artifact(dest_id, path)
