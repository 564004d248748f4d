"""The MLflow record of one training run, written by rank 0 only.

One MLflow run per training run. It is found again after a restart by the
`run_key` tag (a hash of the absolute run directory), so a restarted worker
group continues the same MLflow run. Steps redone after restoring a
checkpoint are not logged again: each metric keeps a high-water mark of its
logged steps (seeded from the store on resume), so every metric's steps stay
strictly increasing and the first-logged value of a step is the one kept.
Metric points go to the store from a background worker (trainlab.track.writer);
everything else (params, tags, artifacts) is written synchronously.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import logging
import math
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainlab.redact import redact
from trainlab.track import heartbeat
from trainlab.track.gitinfo import git_info
from trainlab.track.heartbeat import Heartbeat
from trainlab.track.plots import loss_curve_figure, mix_share_figure, normalized_mix
from trainlab.track.store import (
    artifact_location,
    client_for,
    get_or_create_experiment,
    tracking_uri,
)
from trainlab.track.writer import MetricWriter
from trainlab.train.callbacks import Callback, RunContext

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)

# MLflow's limits (mlflow.utils.validation): values beyond them are refused.
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
PARAMS_PER_BATCH = 100
TAGS_PER_BATCH = 100

# Plan numbers worth a column in a comparison (prefixed `plan.` as params).
PLAN_HEADLINE = (
    "num_params",
    "world_size",
    "strategy",
    "flops_per_token",
    "micro_batch_size",
    "global_batch_size",
    "tokens_per_step",
    "fits",
)

SYSTEM_METRICS_INTERVAL_S = 10.0
ALERT_LOG_ARTIFACT = "alerts.jsonl"

_METRIC_NAME_BAD = re.compile(r"[^A-Za-z0-9_\-. :/]")

# The training loop's statuses -> MLflow's terminal run statuses.
_MLFLOW_STATUS = {
    "completed": "FINISHED",
    "finished": "FINISHED",
    "stopped": "KILLED",
    "stopped_by_alert": "KILLED",
    "interrupted": "KILLED",  # Ctrl-C (the status tag says which)
    "lost": "FAILED",  # its processes vanished (trainlab.track.heartbeat)
    "killed": "KILLED",
    "cancelled": "KILLED",
}


# --------------------------------------------------------------------------- pure helpers


def run_key(run_dir: str) -> str:
    """Identity of a training run in MLflow: a hash of its absolute run directory."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:32]


def experiment_name(cfg: Any) -> str:
    """`tracking.experiment`, else the run name (load_config fills in the recipe family)."""
    return cfg.tracking.experiment or cfg.name


def param_value(value: Any) -> str:
    """A config value as an MLflow param: strings as they are, the rest as JSON."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return redact(text)[:MAX_PARAM_VALUE]  # a URL never carries its credentials here


def run_params(cfg: Any, plan: dict[str, Any]) -> dict[str, str]:
    """The fully resolved config flattened to dotted keys, plus the plan's headline numbers."""
    from trainlab.config import flatten

    params = {k: param_value(v) for k, v in flatten(cfg.model_dump(mode="json")).items()}
    for key in PLAN_HEADLINE:
        if key in plan:
            params[f"plan.{key}"] = param_value(plan[key])
    for key, value in (plan.get("parallel") or {}).items():
        params[f"plan.{key}"] = param_value(value)
    memory = (plan.get("memory_per_device_bytes") or {}).get("total")
    if memory is not None:
        params["plan.memory_per_device_gb"] = f"{memory / 2**30:.3f}"
    return params


def run_tags(ctx: RunContext) -> dict[str, str]:
    """Who, why, and exactly what: the tags every run carries from its start."""
    cfg = ctx.cfg
    git = ctx.extra.get("git") or git_info()
    purpose, expectation = cfg.purpose.strip(), cfg.expectation.strip()
    note = f"**Purpose:** {purpose}\n\n**Expectation:** {expectation}"
    tags = {
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
        "config_hash": ctx.config_hash,
        "dataset_fingerprint": ctx.dataset_fingerprint,
        "purpose": purpose,
        "expectation": expectation,
        "owner": cfg.owner,
        "status": "running",
        "restarts": str(ctx.restarts),
        "run_dir": str(ctx.run_dir),
        "run_key": run_key(ctx.run_dir),
        "mlflow.source.git.commit": git["commit"],
        "mlflow.user": cfg.owner or getpass.getuser(),
        "mlflow.note.content": note,
    }
    job_id = ctx.ray_job_id or submitted_job_id()
    if job_id:
        tags["ray_job_id"] = job_id
    return {k: redact(v)[:MAX_TAG_VALUE] for k, v in tags.items()}


def submitted_job_id() -> str | None:
    """The Ray job submission id when this process is (a child of) a submitted
    job's driver: the job supervisor passes it in the job config env var."""
    import os

    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return None
    try:
        return json.loads(raw).get("metadata", {}).get("job_submission_id") or None
    except (ValueError, AttributeError):
        return None


def metric_name(key: str) -> str:
    """A loop metric key as a valid MLflow metric name."""
    return _METRIC_NAME_BAD.sub("_", key)


def _is_rank_zero() -> bool:
    """False only inside a Ray Train worker whose world rank is not 0 (a guard:
    the loop is meant to call callbacks on rank 0 only)."""
    if "ray.train" not in sys.modules:
        return True
    try:
        import ray.train

        return ray.train.get_context().get_world_rank() == 0
    except Exception:  # noqa: BLE001 - not inside a train worker
        return True


class StepFilter:
    """Per-metric high-water marks: admits a point only if its step is beyond
    every step already logged for that metric."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def seed(self, key: str, step: int) -> None:
        self.last[key] = max(self.last.get(key, -1), step)

    def admit(self, key: str, step: int) -> bool:
        if step <= self.last.get(key, -1):
            return False
        self.last[key] = step
        return True


# --------------------------------------------------------------------------- the callback


class MlflowCallback(Callback):
    """Creates (or continues) the run's MLflow record and writes everything into it.

    Also the tracker the monitor writes through: `log_metrics`, `set_tags`,
    `log_artifact`. Holds no connection until `on_run_start`, so it pickles.
    """

    def __init__(self, cfg: Any, runs_root: str | None = None):
        self.cfg = cfg
        # Resolved now when given: in a Ray worker the current directory may differ.
        self.runs_root = str(Path(runs_root).resolve()) if runs_root else None
        self.run_id: str | None = None
        self.tracking_uri: str | None = None
        self._client: MlflowClient | None = None
        self._steps = StepFilter()
        self._system_monitor: Any = None
        self._writer: MetricWriter | None = None
        self._run_dir: str = ""
        self._best_val_loss = math.inf
        self._heartbeat: Heartbeat | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        state["_system_monitor"] = None
        state["_writer"] = None
        state["_heartbeat"] = None
        return state

    # ---------------------------------------------------------------- tracker API

    def log_metrics(self, step: int, metrics: dict[str, float]) -> int:
        """Log numeric metrics at `step`, skipping steps already logged; returns the count."""
        if self._client is None or self.run_id is None:
            return 0
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = []
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            name = metric_name(key)
            if self._steps.admit(name, step):
                points.append(Metric(name, float(value), now, int(step)))
        if self._writer is not None:
            self._writer.put(points)
        return len(points)

    def flush(self) -> None:
        """Wait until the metrics logged so far are in the store."""
        if self._writer is not None:
            self._writer.flush()

    def set_tags(self, tags: dict[str, str]) -> None:
        if self._client is None or self.run_id is None:
            return
        from mlflow.entities import RunTag

        items = [RunTag(k, redact(str(v))[:MAX_TAG_VALUE]) for k, v in tags.items()]
        for i in range(0, len(items), TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, tags=items[i : i + TAGS_PER_BATCH])

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        if self._client is not None and self.run_id is not None:
            self._client.log_artifact(self.run_id, path, artifact_path)

    # ---------------------------------------------------------------- hooks

    def on_run_start(self, ctx: RunContext) -> None:
        if not _is_rank_zero():
            log.warning("MLflow callback called off rank 0; not logging from this worker")
            return
        # The same callback sees every in-place restart (trainlab.train.agent):
        # one system-metrics thread at a time.
        self._stop_system_metrics()
        self._close_writer()
        active = self._heartbeat.stop() if self._heartbeat is not None else None
        runs_root = self._connect(str(ctx.run_dir))
        exp_id = get_or_create_experiment(
            self._client, experiment_name(ctx.cfg), artifact_location(runs_root)
        )
        existing = self._find_run(exp_id, run_key(ctx.run_dir))
        if existing is None:
            self._start_new_run(exp_id, ctx)
            resumed = False
        else:
            self._resume_run(existing, ctx)
            resumed = True
        self._writer = MetricWriter(self._client, self.run_id)
        # In-place restarts continue this start's active time; a resume, the record's.
        before = active if active is not None else heartbeat.active_before(existing)
        self._heartbeat = Heartbeat(self._client, self.run_id, before).start()
        self._start_system_metrics(resumed)
        log.info(
            "MLflow run %s (%s) at %s",
            self.run_id,
            "continued" if resumed else "new",
            redact(self.tracking_uri or ""),
        )

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.log_metrics(step, metrics)

    def on_eval(self, step: int, val_losses: dict[str, float]) -> None:
        self.log_metrics(step, {f"val_loss/{k}": v for k, v in val_losses.items()})

    def on_checkpoint(self, step: int, path: str, valid: bool, val_loss: float | None) -> None:
        tags = {"checkpoint.latest": path, "checkpoint.latest_valid": str(valid).lower()}
        if valid and val_loss is not None and val_loss < self._best_val_loss:
            self._best_val_loss = val_loss
            tags |= {"checkpoint.best": path, "checkpoint.best_val_loss": f"{val_loss:.6g}"}
        self.set_tags(tags)
        if valid and self.cfg.tracking.log_checkpoints and Path(path).is_dir():
            self._client.log_artifacts(self.run_id, path, f"checkpoints/{Path(path).name}")

    def on_run_end(self, summary: dict[str, Any]) -> None:
        if self._client is None or self.run_id is None:
            return
        self._close_writer()  # the curves below are read back from the store
        try:
            self._log_end_artifacts(summary)
            self._log_memory(summary)
        finally:
            self._stop_system_metrics()
            if self._heartbeat is not None:
                self._heartbeat.stop()
                self._heartbeat = None
            status = str(summary.get("status", "completed")).lower()
            tags = {"status": status}
            for key in ("last_checkpoint", "best_checkpoint", "weights_sha256"):
                if summary.get(key):
                    tags[key] = str(summary[key])
            self.set_tags(tags)
            self._client.set_terminated(self.run_id, _MLFLOW_STATUS.get(status, "FAILED"))

    def _log_memory(self, summary: dict[str, Any]) -> None:
        """Peak memory per device (max over ranks) next to the plan's estimate."""
        peak, planned = summary.get("peak_memory_bytes"), summary.get("planned_memory_bytes")
        values = {"peak_memory_bytes": peak, "planned_memory_bytes": planned}
        if peak and planned:
            values["memory_estimate_error"] = planned / peak - 1
        step = int(summary.get("final_step") or 0)
        for key, value in values.items():
            if value is not None:
                self._client.log_metric(self.run_id, key, float(value), step=step)

    def on_run_abandoned(self, run_dir: str, summary: dict[str, Any]) -> None:
        """The driver's close of a run whose workers never reached `on_run_end`
        (Ray Train gave up): attach to the MLflow run of `run_dir`, if there is
        one, and end it as `on_run_end` would (run_summary.json, alert log,
        curves, status tag and MLflow status). Nothing happens without a run."""
        if self.attach(run_dir):
            self.on_run_end(summary)

    def attach(self, run_dir: str) -> bool:
        """Connect to the existing MLflow run of `run_dir` without creating one
        (for closing a run from the driver); False when there is none."""
        self._connect(run_dir)
        exp = self._client.get_experiment_by_name(experiment_name(self.cfg))
        run = self._find_run(exp.experiment_id, run_key(run_dir)) if exp else None
        if run is None:
            return False
        self.run_id = run.info.run_id
        return True

    # ---------------------------------------------------------------- internals

    def _connect(self, run_dir: str) -> str:
        """Open the store for `run_dir`; returns the runs root it lives in."""
        self._run_dir = run_dir
        # Contract: the run directory is {runs_root}/{date}/{name}.
        runs_root = self.runs_root or str(Path(run_dir).resolve().parents[1])
        self.tracking_uri = tracking_uri(runs_root)
        self._client = client_for(self.tracking_uri)
        return runs_root

    def _find_run(self, exp_id: str, key: str) -> Any:
        runs = self._client.search_runs(
            [exp_id],
            filter_string=f"tags.run_key = '{key}'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        return runs[0] if runs else None

    def _start_new_run(self, exp_id: str, ctx: RunContext) -> None:
        from mlflow.entities import Param

        # Named after its run directory ({name}, {name}-2, ...: unique per date), so
        # the UI tells apart runs of one config; `runs`/`compare` also match cfg.name.
        run_name = Path(ctx.run_dir).name
        run = self._client.create_run(exp_id, run_name=run_name, tags=run_tags(ctx))
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in run_params(ctx.cfg, ctx.plan).items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[i : i + PARAMS_PER_BATCH])
        self._log_start_artifacts(ctx)

    def _resume_run(self, run: Any, ctx: RunContext) -> None:
        self.run_id = run.info.run_id
        # The latest point of each metric is the one at its largest step.
        for metric in run.data._metric_objs:
            self._steps.seed(metric.key, metric.step)
        best = run.data.tags.get("checkpoint.best_val_loss")
        if best:
            self._best_val_loss = min(self._best_val_loss, float(best))
        self._client.update_run(self.run_id, status="RUNNING")
        tags = {"status": "running", "restarts": str(ctx.restarts)}
        if ctx.ray_job_id:
            tags["ray_job_id"] = ctx.ray_job_id
        self.set_tags(tags)

    def _log_start_artifacts(self, ctx: RunContext) -> None:
        from trainlab.config import to_yaml

        self._client.log_text(self.run_id, to_yaml(ctx.cfg), "config.yaml")
        self._client.log_dict(self.run_id, ctx.plan, "plan.json")
        if ctx.manifest_path and Path(ctx.manifest_path).is_file():
            self._client.log_artifact(self.run_id, ctx.manifest_path, "data")

    def _log_end_artifacts(self, summary: dict[str, Any]) -> None:
        self._client.log_dict(self.run_id, summary, "run_summary.json")
        self._log_alert_log()
        self._log_figures()

    def _log_alert_log(self) -> None:
        from trainlab.monitor import alert_log_path

        path = alert_log_path(self._run_dir)
        if path.is_file():
            self._client.log_artifact(self.run_id, str(path))
        else:  # the artifact is always there; empty means no alert fired
            self._client.log_text(self.run_id, "", ALERT_LOG_ARTIFACT)

    def _log_figures(self) -> None:
        from trainlab.track.series import metric_series

        series = metric_series(self._client, self.run_id, prefixes=("loss", "val_loss/", "share/"))
        val = {
            k.removeprefix("val_loss/"): v for k, v in series.items() if k.startswith("val_loss/")
        }
        shares = {k.removeprefix("share/"): v for k, v in series.items() if k.startswith("share/")}
        name = self.cfg.name
        self._client.log_figure(
            self.run_id,
            loss_curve_figure(series.get("loss", []), val, title=f"{name}: loss"),
            "loss_curve.png",
        )
        self._client.log_figure(
            self.run_id,
            mix_share_figure(
                shares, normalized_mix(self.cfg.data.mix), title=f"{name}: delivered token share"
            ),
            "mix_shares.png",
        )

    def _start_system_metrics(self, resumed: bool) -> None:
        if not self.cfg.tracking.system_metrics:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self._system_monitor = SystemMetricsMonitor(
            self.run_id,
            sampling_interval=SYSTEM_METRICS_INTERVAL_S,
            resume_logging=resumed,
            tracking_uri=self.tracking_uri,
        )
        self._system_monitor.start()

    def _close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _stop_system_metrics(self) -> None:
        if self._system_monitor is not None:
            self._system_monitor.finish()
            self._system_monitor = None


def close_run(
    cfg: Any, run_dir: str, summary: dict[str, Any], runs_root: str | None = None
) -> str | None:
    """End the MLflow run of `run_dir` from outside the workers (e.g. the driver
    after the run failed for good, when rank 0 could not): run_summary.json,
    alert log, curves, status tag and MLflow status. Returns the run id, or None
    when that training run has no MLflow run."""
    tracker = MlflowCallback(cfg, runs_root=runs_root)
    tracker.on_run_abandoned(run_dir, summary)
    return tracker.run_id
