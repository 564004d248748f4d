"""The MLflow record of one training run, written by rank 0 only.

One MLflow run per training run. It is found again after a restart by the
`run_key` tag (a hash of the absolute run directory), so a restarted worker
group continues the same MLflow run. Steps redone after restoring a
checkpoint are not logged again: each metric keeps a high-water mark of its
logged steps (seeded from the store on resume), so every metric's steps stay
strictly increasing and the first-logged value of a step is the one kept.
Every record goes through the run's journal first (trainlab.track.journal) and
reaches the store from a background flusher: a busy store delays it, never loses it.
"""

from __future__ import annotations

import getpass
import json
import logging
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainlab.redact import redact
from trainlab.runstatus import RunStatus
from trainlab.track import heartbeat
from trainlab.track.backend import (
    artifact_location,
    client_for,
    fail_fast_on_outage,
    tracking_uri,
)
from trainlab.track.gitinfo import git_info
from trainlab.track.heartbeat import Heartbeat
from trainlab.track.journal import (  # noqa: F401 - run_key re-exported
    FLUSH_COMMAND,
    Flusher,
    Journal,
    end_wait_s,
    now_ms,
    run_key,
)
from trainlab.train.loop.callbacks import Callback, RunContext

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
    RunStatus.COMPLETED: "FINISHED",
    "finished": "FINISHED",
    RunStatus.STOPPED: "KILLED",
    RunStatus.STOPPED_BY_ALERT: "KILLED",
    RunStatus.INTERRUPTED: "KILLED",  # Ctrl-C (the status tag says which)
    RunStatus.LOST: "FAILED",  # its processes vanished (trainlab.track.heartbeat)
    "killed": "KILLED",
    "cancelled": "KILLED",
}


# --------------------------------------------------------------------------- pure helpers


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


# The run's real length: MLflow's params cannot change once logged, so a run
# continued with `trainlab train --extend` keeps `train.total_steps` as it started;
# these tags say how long it is now and what its extensions were
# (logs/extensions.jsonl, trainlab.run.dir).
TOTAL_STEPS_TAG = "total_steps"
EXTENDED_TAG = "extended"


def length_tags(cfg: Any, run_dir: str) -> dict[str, str]:
    """`total_steps` (the length the run trains to now) and, for an extended run,
    `extended`: each extension, e.g. "train.total_steps 60 -> 80 at step 60"."""
    from trainlab.run.records import RunRecords

    tags = {TOTAL_STEPS_TAG: str(cfg.train.total_steps)}
    try:
        extensions = RunRecords(run_dir).extensions()
    except (OSError, ValueError) as e:  # the record is the run's; tracking goes on
        log.warning("%s: extensions not read (%s)", run_dir, e)
        extensions = []
    said = [describe_extension(e) for e in extensions]
    if said:
        tags[EXTENDED_TAG] = "; ".join(s for s in said if s)
    return tags


def describe_extension(record: dict[str, Any]) -> str:
    """One logs/extensions.jsonl record in words."""
    at = record.get("at_step")
    where = f" at step {at}" if at is not None else ""
    return ", ".join(
        f"{key} {before} -> {after}{where}"
        for key, (before, after) in (record.get("changed") or {}).items()
    )


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


# MLflow's UI shows a run's charts by section, a metric's section being its name up
# to the last "/": named sections first, in alphabetical order, then the unnamed
# ("Model metrics": loss, lr, ...) last, so `loss` came after `share/*` and
# `val_loss/*`. The losses are also logged in a section that sorts first:
# `loss/train` (= loss) and `loss/val` (= val_loss/all). Readers use loss and val_loss/*.
CHART_LOSS = {"loss": "loss/train"}
CHART_VAL_LOSS = {"all": "loss/val"}


def step_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A step's metrics as logged: the loop's, and the loss again for the charts."""
    return metrics | {chart: metrics[k] for k, chart in CHART_LOSS.items() if k in metrics}


def eval_metrics(val_losses: dict[str, float]) -> dict[str, float]:
    """An evaluation's metrics as logged: val_loss/SOURCE, and val_loss/all again
    for the charts."""
    logged = {f"val_loss/{k}": v for k, v in val_losses.items()}
    return logged | {chart: val_losses[k] for k, chart in CHART_VAL_LOSS.items() if k in val_losses}


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

    Every record goes through the run's journal (trainlab.track.journal:
    `{run_dir}/logs/mlflow-journal.jsonl`, fsynced) and reaches the store from a
    background flusher; a store that is locked, slow or down delays the record,
    never loses it. Also the tracker the monitor writes through: `log_metrics`,
    `set_tags`, `log_artifact`. Holds no connection until `on_run_start`, so it
    pickles.
    """

    def __init__(self, cfg: Any, runs_root: str | None = None):
        self.cfg = cfg
        # Resolved now when given: in a Ray worker the current directory may differ.
        self.runs_root = str(Path(runs_root).resolve()) if runs_root else None
        self.run_id: str | None = None
        self.tracking_uri: str | None = None
        self.records_pending = 0  # entries the store had not taken at the run's end
        self._client: MlflowClient | None = None
        self._steps = StepFilter()
        self._system_monitor: Any = None
        self._journal: Journal | None = None
        self._flusher: Flusher | None = None
        self._run_dir: str = ""
        self._best_val_loss = math.inf
        self._heartbeat: Heartbeat | None = None
        self._active_before: float | None = None
        self._ending = False  # on_run_end under way: no heartbeat is started any more

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        state["_system_monitor"] = None
        state["_journal"] = None
        state["_flusher"] = None
        state["_heartbeat"] = None
        return state

    # ---------------------------------------------------------------- tracker API

    def log_metrics(self, step: int, metrics: dict[str, float]) -> int:
        """Log numeric metrics at `step`, skipping steps already logged; returns the count."""
        if self._journal is None:
            return 0
        now = now_ms()
        points = []
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            name = metric_name(key)
            if self._steps.admit(name, step):
                points.append([name, float(value), now, int(step)])
        if points:
            self._record({"op": "metrics", "points": points})
        return len(points)

    def finish(self, timeout: float = 30.0) -> int:
        """After `attach` and some records (an export's tags and artifacts): write
        them (bounded by `timeout`) and stop; returns how many still wait in the
        journal (the next command that opens the store writes them)."""
        left = self._close_flusher(timeout)
        if self._journal is not None:
            self.run_id = self._journal.state().get("run_id") or self.run_id
        return left

    def flush(self, timeout: float = 120.0) -> int:
        """Wait (bounded) until the records so far are in the store; returns how
        many still wait."""
        if self._flusher is None:
            return 0
        return self._flusher.wait(timeout)

    def set_tags(self, tags: dict[str, str]) -> None:
        if self._journal is None:
            return
        items = {k: redact(str(v))[:MAX_TAG_VALUE] for k, v in tags.items()}
        self._record({"op": "tags", "tags": items})

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        if self._journal is not None:
            self._record(
                {
                    "op": "artifact",
                    "path": str(Path(path).resolve()),
                    "artifact_path": artifact_path,
                }
            )

    # ---------------------------------------------------------------- hooks

    def on_run_start(self, ctx: RunContext) -> None:
        if not _is_rank_zero():
            log.warning("MLflow callback called off rank 0; not logging from this worker")
            return
        # The same callback sees every in-place restart (trainlab.train.supervision.agent):
        # one system-metrics thread and one flusher at a time.
        self._stop_system_metrics()
        self._close_flusher(0.0)
        # In-place restarts continue this start's active time; a resume, the record's.
        self._active_before = self._heartbeat.stop() if self._heartbeat is not None else None
        self._heartbeat = None
        self._ending = False
        runs_root = self._open(str(ctx.run_dir))
        assert self._journal is not None
        for key, step in self._journal.metric_high_water().items():
            self._steps.seed(key, step)
        self._journal.append([self._start_entry(ctx, runs_root)])
        # One attempt now (a free store: the run exists before the first step, and a
        # run from before journals is seeded from the store); then in the background.
        if self._flusher is not None:
            self._flusher.try_flush()
            self._flusher.start()

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.log_metrics(step, step_metrics(metrics))

    def on_eval(self, step: int, val_losses: dict[str, float]) -> None:
        self.log_metrics(step, eval_metrics(val_losses))

    def on_resize(self, record: dict[str, Any]) -> None:
        """An elastic run's resize: its numbers as metrics at its step (the list is in
        run_summary.json's `resizes`)."""
        keys = ("to_world_size", "to_dp", "steps_redone", "seconds")
        values = {f"resize/{k}": float(record[k]) for k in keys if record.get(k) is not None}
        self.log_metrics(int(record["step"]), values)

    def on_checkpoint(self, step: int, path: str, valid: bool, val_loss: float | None) -> None:
        tags = {"checkpoint.latest": path, "checkpoint.latest_valid": str(valid).lower()}
        if valid and val_loss is not None and val_loss < self._best_val_loss:
            self._best_val_loss = val_loss
            tags |= {"checkpoint.best": path, "checkpoint.best_val_loss": f"{val_loss:.6g}"}
        self.set_tags(tags)
        if valid and self.cfg.tracking.log_checkpoints and Path(path).is_dir():
            self._record(
                {
                    "op": "artifacts",
                    "path": str(Path(path).resolve()),
                    "artifact_path": f"checkpoints/{Path(path).name}",
                }
            )

    def on_run_end(self, summary: dict[str, Any]) -> None:
        if self._journal is None:
            return
        self._ending = True
        self._stop_system_metrics()
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        status = str(summary.get("status", RunStatus.COMPLETED)).lower()
        tags = {"status": status}
        for key in ("last_checkpoint", "best_checkpoint", "weights_sha256", "error"):
            if summary.get(key):
                tags[key] = str(summary[key])
        entries = [
            *self._memory_entries(summary),
            {"op": "dict", "data": summary, "file": "run_summary.json"},
            self._alert_log_entry(),
            {"op": "figures", "name": self.cfg.name, "mix": dict(self.cfg.data.mix)},
            {"op": "tags", "tags": {k: redact(v)[:MAX_TAG_VALUE] for k, v in tags.items()}},
            {"op": "end", "status": _MLFLOW_STATUS.get(status, "FAILED"), "time": now_ms()},
        ]
        self._journal.append(entries)
        left = self._close_flusher(end_wait_s())
        self.run_id = self._journal.state().get("run_id") or self.run_id
        self.records_pending = left
        if left:
            self._say_pending(summary, left)

    def _say_pending(self, summary: dict[str, Any], left: int) -> None:
        """The run ends with records not in the store: its summary says so."""
        from trainlab.run.records import RunRecords

        assert self._journal is not None
        log.warning(
            "%d record(s) of this run are not in the MLflow store yet (it did not answer); "
            "they wait in %s: `%s %s` or any trainlab command that opens the store "
            "(e.g. trainlab runs) writes them",
            left,
            self._journal.path,
            FLUSH_COMMAND,
            self._run_dir,
        )
        summary["records_pending"] = left
        records = RunRecords(self._run_dir)
        written = records.read_summary()
        if written is not None and written.get("status") == summary.get("status"):
            records.write_summary({**written, "records_pending": left})

    def _memory_entries(self, summary: dict[str, Any]) -> list[dict[str, Any]]:
        """Peak memory per device (max over ranks) next to the plan's estimate."""
        peak, planned = summary.get("peak_memory_bytes"), summary.get("planned_memory_bytes")
        values = {"peak_memory_bytes": peak, "planned_memory_bytes": planned}
        if peak and planned:
            values["memory_estimate_error"] = planned / peak - 1
        step = int(summary.get("final_step") or 0)
        now = now_ms()
        points = [[k, float(v), now, step] for k, v in values.items() if v is not None]
        return [{"op": "metrics", "points": points}] if points else []

    def _alert_log_entry(self) -> dict[str, Any]:
        from trainlab.monitor import alert_log_path

        path = alert_log_path(self._run_dir)
        if path.is_file():
            return {"op": "artifact", "path": str(path.resolve()), "artifact_path": None}
        # The artifact is always there; empty means no alert fired.
        return {"op": "text", "text": "", "file": ALERT_LOG_ARTIFACT}

    def on_run_abandoned(self, run_dir: str, summary: dict[str, Any]) -> None:
        """The driver's close of a run whose workers never reached `on_run_end`
        (Ray Train gave up): attach to the MLflow record of `run_dir`, if there is
        one (its journal, or a run in the store), and end it as `on_run_end` would
        (run_summary.json, alert log, curves, status tag and MLflow status).
        Nothing happens without a record."""
        if self.attach(run_dir):
            self.on_run_end(summary)

    def attach(self, run_dir: str) -> bool:
        """Open the record of `run_dir` without creating one (for closing a run
        from the driver); False when there is none."""
        self._open(run_dir)
        assert self._journal is not None
        if self._journal.has_start():
            return True
        try:  # a run recorded before journals
            client = self._connect()
            exp = client.get_experiment_by_name(experiment_name(self.cfg))
            run = self._find_run(client, exp.experiment_id, run_key(run_dir)) if exp else None
        except Exception as e:  # noqa: BLE001 - no store, no record to close
            log.warning(
                "MLflow store did not answer; cannot close the record of %s: %s", run_dir, e
            )
            run = None
        if run is None:
            self._journal = None
            self._flusher = None
            return False
        self.run_id = run.info.run_id
        return True

    # ---------------------------------------------------------------- internals

    def _open(self, run_dir: str) -> str:
        """The journal of `run_dir` and its flusher (not started); returns the
        runs root whose store it goes to."""
        self._run_dir = run_dir
        # The store is the runs root's (never derived from where the run directory
        # is: a --run-dir elsewhere still records where `trainlab runs` looks); for
        # a runs root in object storage, its working copy on this node.
        from trainlab.run.location import RunLocation, local_runs_root

        scratch = self.cfg.resource.scratch_dir
        runs_root = self.runs_root or str(local_runs_root(self.cfg.train.runs_root, scratch))
        self.tracking_uri = tracking_uri(runs_root)
        fail_fast_on_outage(self.tracking_uri)  # the journal retries, not MLflow's client
        self._journal = Journal(str(RunLocation.of(run_dir, scratch).local))
        self._flusher = Flusher(
            self._journal, self._connect, self.tracking_uri, on_start=self._store_ready
        )
        return runs_root

    def _connect(self) -> MlflowClient:
        """Open the store (the flusher's client; another run's pending records are
        flushed by commands, not by training processes)."""
        assert self.tracking_uri is not None
        self._client = client_for(self.tracking_uri, flush_records=False)
        return self._client

    def _record(self, entry: dict[str, Any]) -> None:
        assert self._journal is not None
        self._journal.append([entry])
        if self._flusher is not None:
            self._flusher.wake()

    def _start_entry(self, ctx: RunContext, runs_root: str) -> dict[str, Any]:
        from trainlab.config import to_yaml
        from trainlab.envlock import mlflow_tags, packages_file, run_environment
        from trainlab.repeats import group_tags

        artifacts: list[dict[str, Any]] = [
            {"text": to_yaml(ctx.cfg), "file": "config.yaml"},
            {"data": ctx.plan, "file": "plan.json"},
        ]
        if ctx.manifest_path:  # the dataset's manifest, wherever the dataset is
            from trainlab.errors import UserError
            from trainlab.location import locate

            try:
                manifest = locate(ctx.manifest_path)
                text = manifest.read_bytes().decode("utf-8")
                artifacts.append({"text": text, "file": f"data/{manifest.name}"})
            except (OSError, UserError, UnicodeDecodeError) as e:
                log.warning("%s: not recorded (%s)", ctx.manifest_path, e)
        # The environment (trainlab.envlock) and a repeat's group (trainlab.repeats).
        env, group = run_environment(ctx.run_dir), group_tags()
        artifacts += [{"data": env, "file": "environment.json"}]
        packages = packages_file(ctx.run_dir)
        artifacts += [{"path": str(packages), "artifact_path": "environment"}] if packages else []
        length = length_tags(ctx.cfg, str(ctx.run_dir))
        resume_tags = {"status": "running", "restarts": str(ctx.restarts), **length}
        if ctx.ray_job_id:
            resume_tags["ray_job_id"] = ctx.ray_job_id
        return {
            "op": "start",
            "time": now_ms(),
            "experiment": experiment_name(ctx.cfg),
            "artifact_location": artifact_location(runs_root),
            "run_key": run_key(ctx.run_dir),
            # Named after its run directory ({name}, {name}-2, ...: unique per date), so
            # the UI tells apart runs of one config; `runs`/`compare` also match cfg.name.
            "run_name": Path(ctx.run_dir).name,
            "tags": {**run_tags(ctx), **mlflow_tags(env), **group, **length},
            "params": run_params(ctx.cfg, ctx.plan),
            "artifacts": artifacts,
            "resume_tags": resume_tags,
        }

    def _store_ready(self, run: Any, existed: bool) -> None:
        """The journal's start reached the store (the flusher's thread): the run's
        id, its high-water marks on resume, its heartbeat and system metrics."""
        self.run_id = run.info.run_id
        if existed:
            # The latest point of each metric is the one at its largest step.
            for metric in run.data._metric_objs:
                self._steps.seed(metric.key, metric.step)
            best = run.data.tags.get("checkpoint.best_val_loss")
            if best:
                self._best_val_loss = min(self._best_val_loss, float(best))
        if self._heartbeat is None and self._client is not None and not self._ending:
            before = (
                self._active_before
                if self._active_before is not None
                else heartbeat.active_before(run if existed else None)
            )
            self._heartbeat = Heartbeat(self._client, self.run_id, before).start()
            self._start_system_metrics(existed)
        log.info(
            "MLflow run %s (%s) at %s",
            self.run_id,
            "continued" if existed else "new",
            redact(self.tracking_uri or ""),
        )

    def _find_run(self, client: Any, exp_id: str, key: str) -> Any:
        runs = client.search_runs(
            [exp_id],
            filter_string=f"tags.run_key = '{key}'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        return runs[0] if runs else None

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

    def _close_flusher(self, timeout: float) -> int:
        """Flush (bounded by `timeout`) and stop the flusher; returns what waits."""
        if self._flusher is None:
            return 0
        flusher, self._flusher = self._flusher, None
        return flusher.close(timeout)

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
