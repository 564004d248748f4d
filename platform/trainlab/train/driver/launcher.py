"""The driver side of `trainlab train`: check, plan, prepare, launch on Ray Train.

`run(cfg)` does, in order: plan the layout and refuse what does not fit or
cannot be executed (tp/pp > 1), check the data (`trainlab.data.prepare_run_data`),
choose the run directory (see trainlab.run.dir for new / --run-dir /
--resume / --extend), return the run's own summary untouched (with
`already_complete`) when that run already completed, refuse to resume a
checkpoint of another experiment or dataset, connect to Ray
(`trainlab.raycluster.ensure_ray`), and run a `TorchTrainer` whose workers
execute `trainlab.train.driver.worker.train_loop_per_worker`.

A worker failure restarts the whole group (`FailureConfig(max_failures)`),
which resumes from the newest valid checkpoint. When the retries are used up,
`run` writes run_summary.json with status "failed" and the list of failures
(step, rank, error) and raises `TrainingFailed`.

Side effects (the experiment record, alerts) come as callbacks named by import
path (`callbacks=`, default `DEFAULT_CALLBACKS`): the training layer imports
none of them itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from trainlab.config import ExperimentConfig
from trainlab.errors import UserError
from trainlab.location import SETTINGS_ENV_VARS
from trainlab.nodedisk import SCRATCH_ENV_VAR, UnsafePath, check_disk_room
from trainlab.plan import plan, require_fit, resolve_layout
from trainlab.run import checkpoints as ckpts
from trainlab.run import dir as rundir
from trainlab.run.location import LogShipper, RunLocation
from trainlab.run.lock import RunLock
from trainlab.run.records import RunRecords
from trainlab.runstatus import RunStatus
from trainlab.train.driver.interrupt import (
    INTERRUPT_STORE_WAIT_S,
    Interrupts,
    call_in_thread,
    end_fit_then_shutdown,
)
from trainlab.train.job import TrainJob
from trainlab.train.summaries import failed_summary, interrupted_summary

log = logging.getLogger("trainlab.train")

# Settings forwarded from the driver to every worker (tracking URI, S3 endpoint and
# region, our own), never a secret: the TrainJob is the Ray Train loop config, which
# Ray records. Credentials come from each node's own environment (docs/security.md).
FORWARDED_ENV_PREFIXES = ("MLFLOW_", "TRAINLAB_", "AWS_")
# Ray Train checks worker health this often; its default (2 s) is most of the
# time a restart takes on a small run.
HEALTH_CHECK_INTERVAL_S = "0.5"
SMOKE_STEPS = 6
SMOKE_KILL_AT = 4
SMOKE_CHECKPOINT_EVERY = 3
# The experiment record (MLflow) and monitoring: callback factories by import path.
DEFAULT_CALLBACKS = ("trainlab.track:default_callbacks",)


class TrainingFailed(Exception):
    """The run failed after its retries; `summary` is its run_summary.json."""

    def __init__(self, summary: dict[str, Any]):
        self.summary = summary
        super().__init__(f"training failed: {summary.get('error')}")


@dataclasses.dataclass(frozen=True)
class DataInfo:
    spec: Any
    fingerprint: str
    manifest_path: str
    sources: list[str]


# --------------------------------------------------------------------------- preparation


def smoke_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """A short rehearsal of `cfg`: the same model, data and layout for a few steps,
    with a checkpoint, a validated resume after an injected worker kill, and the end."""
    d = cfg.model_dump()
    t = d["train"]
    t["total_steps"] = SMOKE_STEPS
    t["warmup_steps"] = min(t["warmup_steps"], 2)
    t["log_interval"] = 1
    t["eval_interval"] = SMOKE_CHECKPOINT_EVERY
    t["eval_batches"] = 1
    t["max_failures"] = max(1, t["max_failures"])
    t["checkpoint"].update(every_steps=SMOKE_CHECKPOINT_EVERY, validate=True)
    t["chaos"] = {"kill_at_steps": [SMOKE_KILL_AT], "kill_rank": cfg.resource.min_workers - 1}
    d["name"] = f"{cfg.name}-smoke"
    return ExperimentConfig.model_validate(d)


def prepare_layout(cfg: ExperimentConfig) -> tuple[ExperimentConfig, dict[str, Any]]:
    """The config with its layout made concrete, and the plan; user errors for
    what cannot run here."""
    from trainlab.models import get_attention
    from trainlab.train.parallel import check_executable

    p = plan(cfg)
    require_fit(p)
    resolved = resolve_layout(cfg, p)
    check_executable(resolved)
    get_attention(resolved.model.attention)
    return resolved, p.to_json()


def prepare_data(cfg: ExperimentConfig) -> DataInfo:
    """Check the prepared dataset and the mix before anything starts (trainlab.data)."""
    from trainlab.data import prepare_run_data

    spec = prepare_run_data(cfg)
    manifest = f"{spec.path.rstrip('/')}/manifest.json"  # a directory or s3:// URI
    return DataInfo(spec, spec.fingerprint, manifest, list(spec.sources))


def check_resumable(
    run_dir: Path | RunLocation, cfg: ExperimentConfig, chash: str, data: DataInfo
) -> None:
    """A checkpoint of the run must be of this experiment (`chash`: the run's, see
    rundir.check_same_experiment) and (unless allowed) dataset. A run whose
    checkpoints are all refused (invalid, corrupted, not committed) is not
    restarted from step 0 over them: the error names each and why."""
    from trainlab.data import check_resume

    loc = run_dir if isinstance(run_dir, RunLocation) else RunLocation.of(run_dir)
    require_valid = cfg.train.checkpoint.validate
    catalog = ckpts.catalog(loc)
    try:
        info = catalog.find_resume(require_valid=require_valid)
        refused = catalog.refusals(require_valid=require_valid) if info is None else []
    except OSError as e:
        raise UserError(f"{loc.uri}: cannot list the run's checkpoints: {e}") from None
    except UnsafePath as e:
        raise UserError(
            f"{loc.uri}: refusing its checkpoints: {e}; nothing was restored. Whoever can "
            "write to the store wrote it: check who can, and delete that checkpoint.json"
        ) from None
    if info is None:
        refused = [(w, why) for w, why in refused if "not committed" not in why]
        if refused:  # never a silent restart from step 0 over them
            why = "; ".join(f"{w.rsplit('/', 1)[-1]} ({reason})" for w, reason in refused)
            raise UserError(
                f"{loc.uri}: no checkpoint to resume from, every one is refused: {why}; "
                "to start over from step 0 deliberately, start a new run (trainlab train "
                f"{loc.uri_of('config.yaml')} without --resume/--run-dir: a new run "
                "directory, these checkpoints stay as they are)"
            )
        return
    problem = ckpts.foreign_config(info, chash)
    if problem:
        raise UserError(problem)
    check_resume(data.spec, ckpts.data_state(info))


def forwarded_env(cfg: ExperimentConfig | None = None) -> dict[str, str]:
    """The driver's MLFLOW_*, TRAINLAB_*, AWS_* settings and the stores' (trainlab.location
    SETTINGS_ENV_VARS) minus every secret
    (trainlab.redact.shareable_env): no credential names, no URL with credentials,
    not the variables the alert hooks name (tracking.alerts)."""
    from trainlab.redact import shareable_env

    hooks = cfg.tracking.alerts.secret_env_names() if cfg is not None else []
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(FORWARDED_ENV_PREFIXES) or k in SETTINGS_ENV_VARS
    }
    env.pop(SCRATCH_ENV_VAR, None)  # each node's own (trainlab.nodedisk.scratch_root)
    return shareable_env(env, also_secret=hooks)


def ray_job_id() -> str | None:
    """The Ray Jobs submission id when this driver runs as a submitted job."""
    if os.environ.get("TRAINLAB_RAY_JOB_ID"):
        return os.environ["TRAINLAB_RAY_JOB_ID"]
    try:
        meta = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("metadata", {})
    except ValueError:
        meta = {}
    return meta.get("job_submission_id")


class _StoreUsers(contextlib.ExitStack):
    """What of a run talks to its storage in the background (its lock's beat, the
    log shipper), closed in reverse order when the run returns. After `abandon()`
    closing them sends nothing more: storage that does not answer would hold each
    close for every retry of its SDK."""

    def __init__(self) -> None:
        super().__init__()
        self._users: list[Any] = []

    def enter(self, user: Any) -> Any:
        self._users.append(user)
        return self.enter_context(user)

    def abandon(self) -> None:
        for user in self._users:
            user.abandon()


def _lock_new(
    lock: _StoreUsers, loc: RunLocation, cfg: ExperimentConfig, base_dir: Path | None
) -> RunLocation:
    """Lock a new run's directory; when another start took the same name a moment
    before (two `train` of one config started together), the next free name
    (`{name}-2`, ...) is taken instead of refusing."""
    from trainlab.run.lock import RunLockHeld

    for _ in range(20):
        try:
            held = RunLock.acquire(loc)
        except RunLockHeld:
            loc = rundir.choose_run_dir(cfg, None, False, base_dir)
            continue
        if not loc.exists("config.yaml"):
            lock.enter(held)
            return loc
        held.release()  # the other start got there first and wrote its config
        loc = rundir.choose_run_dir(cfg, None, False, base_dir)
    raise UserError(f"{loc.uri}: no free run directory name after 20 tries")


def _check_writable(loc: RunLocation) -> None:
    """The runs root takes writes (a probe written, read back and deleted where
    they go: a store answers, a disk is not read-only), before anything of the run
    is written; else UserError naming it."""
    loc.home.parent.parent.check_writable()


def _ray_storage(loc: RunLocation) -> dict[str, Any]:
    """Ray Train's own bookkeeping (`storage_path`): next to the run, through the
    run's own filesystem (this disk's, or the store's: no node needs a shared
    disk for a run in object storage)."""
    return {"storage_path": loc.key("ray"), "storage_filesystem": loc.home.filesystem}


def _driver_log(run_dir: Path) -> None:
    handler = logging.FileHandler(run_dir / "logs" / "driver.log")
    handler.setFormatter(
        logging.Formatter("%(asctime)s driver %(levelname)s %(name)s: %(message)s")
    )
    logging.getLogger("trainlab").addHandler(handler)
    logging.getLogger("trainlab").setLevel(logging.INFO)


# --------------------------------------------------------------------------- run


def run(
    cfg: ExperimentConfig,
    *,
    run_dir: str | Path | None = None,
    resume: bool = False,
    smoke: bool = False,
    extend: bool = False,
    base_dir: Path | None = None,
    callbacks: tuple[str, ...] = DEFAULT_CALLBACKS,
) -> dict[str, Any]:
    """Train `cfg` on Ray Train; return the run summary (run_summary.json).

    `base_dir` is what a relative train.runs_root is relative to (default: the
    checkout holding trainlab; `load_config` already anchors a file's paths); `callbacks` are import paths ("module:function") of
    factories `function(cfg) -> list[Callback]` run on rank 0. Raises UserError before anything starts for what the user
    must fix, and TrainingFailed when the run fails after `train.max_failures`
    restarts. A run directory whose run already completed is returned as its
    summary plus `already_complete: True`, untouched; `extend` continues it to a
    larger train.total_steps (rundir.check_same_experiment). Ctrl-C
    (trainlab.train.driver.interrupt) returns the summary with status "interrupted".
    """
    # The run directory's lock (trainlab.run.lock) is held from before the first
    # write into it until this returns: one writer per run.
    with Interrupts() as interrupts, _StoreUsers() as lock:
        return _run(cfg, interrupts, lock, run_dir, resume, smoke, extend, base_dir, callbacks)


def _run(
    cfg: ExperimentConfig,
    interrupts: Interrupts,
    lock: _StoreUsers,
    run_dir: str | Path | None,
    resume: bool,
    smoke: bool,
    extend: bool,
    base_dir: Path | None,
    callbacks: tuple[str, ...],
) -> dict[str, Any]:
    started = time.time()
    if smoke:
        cfg = smoke_config(cfg)
    cfg, plan_json = prepare_layout(cfg)
    data = _checked_together(cfg)
    loc = rundir.choose_run_dir(cfg, run_dir, resume and not smoke, base_dir)
    path = loc.local  # the run directory, or this node's working copy of a run in a store
    # Every process reads the runs root as the driver resolved it (a config built in
    # code may give it relative to `base_dir`): its MLflow store is that root's.
    root = rundir.root_location(cfg, base_dir).resolved().uri
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"runs_root": root})})
    _check_writable(loc)
    if run_dir is not None:
        rundir.check_usable(loc)  # never a folder of the user's files
    identity = rundir.check_same_experiment(loc, cfg, extend=extend)  # reads only
    done = rundir.completed_summary(loc, cfg)
    if done is not None:  # nothing to do: not one file of the run is touched
        return {**done, "already_complete": True}
    chash = identity.config_hash
    # Locked before the first write into it; a new run's directory is made only
    # after the checks below pass, so a refused start leaves nothing behind.
    new = run_dir is None and not (resume and not smoke)  # a name chosen just now
    locked = loc.home.exists()
    if locked and new:  # another start took the name meanwhile: the next free one
        loc = _lock_new(lock, loc, cfg, base_dir)
        path = loc.local
    elif locked:
        lock.enter(RunLock.acquire(loc))
    check_resumable(loc, cfg, chash, data)
    check_disk_room(  # else UserError; a store has no disk to fill
        loc.home,
        cfg.train.checkpoint,
        plan_json["num_params"],
        plan_json.get("checkpoint_bytes_per_param", 12),
    )
    if not locked and new:
        loc = _lock_new(lock, loc, cfg, base_dir)
        path = loc.local
    elif not locked:
        lock.enter(RunLock.acquire(loc))
    if identity.extension is not None:
        RunRecords(loc).add_extension(identity.extension)
    rundir.write_run_files(loc, cfg, plan_json)
    RunRecords(loc).clear_interrupt()  # a Ctrl-C of an earlier start is done with
    _driver_log(path)
    lock.enter(LogShipper(loc))  # a store's run: driver.log, ray.log, the MLflow journal
    job = TrainJob(
        cfg=cfg,
        plan=plan_json,
        run_dir=loc.uri,
        config_hash=chash,
        dataset_fingerprint=data.fingerprint,
        manifest_path=data.manifest_path,
        data_spec=data.spec,
        sources=tuple(data.sources),
        session=uuid.uuid4().hex[:12],
        started_at=started,
        callbacks=tuple(callbacks),
        env=forwarded_env(cfg),
        torch_threads=max(1, int(cfg.resource.cpus_per_worker)),
        ray_job_id=ray_job_id(),
        driver=_driver_record(loc),
    )
    log.info(
        "run %s: %s, %s worker(s), %s; run dir %s",
        cfg.name,
        plan_json["strategy"],
        _workers_text(cfg),
        cfg.train.precision,
        loc.uri,
    )
    interrupts.attach(loc, job.session)
    try:
        summary = _fit(cfg, job)
    except KeyboardInterrupt:  # a Ctrl-C during start-up, or a second one: stop at once
        return _interrupted(job, shutdown=True, store_users=lock)
    except UserError:  # the cluster or a node refused before any worker started
        if new and not RunRecords(loc).attempts():  # this start's directory, nothing ran
            lock.close()  # the lock and the log shipper end before their directory goes
            _remove_refused(loc)
        raise
    if smoke and summary.get("status") != RunStatus.INTERRUPTED:
        summary = _check_smoke(loc, summary)
    return summary


def _fit(cfg: ExperimentConfig, job: TrainJob) -> dict[str, Any]:
    import ray.train
    from ray.train.torch import TorchConfig

    from trainlab import hooksecrets
    from trainlab.envlock import check_nodes
    from trainlab.raycluster import ensure_ray
    from trainlab.train.driver.placement import excluded_nodes, lost_nodes, node_selector
    from trainlab.train.driver.startup import StartupNotes
    from trainlab.train.driver.worker import train_loop_per_worker
    from trainlab.train.supervision.failures import FailureRecorder
    from trainlab.train.supervision.logs import route_worker_output

    notes = StartupNotes()  # what it waits for, until the first step (stderr)
    notes.ray()
    ensure_ray(num_cpus=cfg.resource.local_num_cpus)
    Interrupts.reclaim()  # Ray's own SIGTERM handler would end the driver at once
    _check_cluster(cfg)
    # Every node on its lock before any worker starts (else UserError, or recorded
    # drift with --allow-env-drift); writes the run's environment.json.
    check_nodes(job.run_dir)
    # After the checks: a refused new run's directory is removed (_remove_refused).
    route_worker_output(job.logs_dir / "ray.log")  # the terminal keeps trainlab's lines
    if Interrupts.requested_now():  # Ctrl-C while Ray started: nothing was trained
        return _interrupted(job)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", HEALTH_CHECK_INTERVAL_S)
    r = cfg.resource
    _check_node_chaos(cfg)
    job = dataclasses.replace(job, driver_node_id=ray.get_runtime_context().get_node_id())
    notes.workers(r.world_size, r.cpus_per_worker, r.use_gpu)
    per_worker = {"CPU": r.cpus_per_worker, **({"GPU": 1} if r.use_gpu else {})}
    if excluded_nodes():  # a job retry after nodes were lost (train.placement)
        log.info(
            "avoiding node(s) %s: a previous attempt lost its workers there",
            ", ".join(excluded_nodes()),
        )
    # The alert hooks' variables (secrets): a submitted job's come encrypted with it;
    # the workers get them through the object store, never in the loop config.
    hook_names = cfg.tracking.alerts.secret_env_names()
    hooksecrets.load_submitted()
    trainer = _trainer_class(cfg, job.run_dir)(
        train_loop_per_worker,
        train_loop_config={"job": job, "hook_secrets": hooksecrets.for_workers(hook_names)},
        scaling_config=ray.train.ScalingConfig(
            **_scaling(cfg),
            use_gpu=r.use_gpu,
            resources_per_worker=per_worker,
            label_selector=node_selector(),
        ),
        torch_config=TorchConfig(backend="nccl" if r.use_gpu else "gloo"),
        run_config=ray.train.RunConfig(
            # Ray's own bookkeeping; checkpoints are trainlab's (see train.checkpoint).
            name=f"ray-{job.session}",
            **_ray_storage(job.location),
            failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures),
            callbacks=[FailureRecorder(job.run_dir, job.session)],
            # Ray's per-report INFO lines would drown the progress lines.
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
    )
    try:
        with notes.waiting(job.run_dir, job.session, r.min_workers):
            call_in_thread(trainer.fit)  # the main thread keeps handling Ctrl-C
    except ray.train.TrainingFailedError as e:
        from trainlab.train.driver.elastic import TooFewWorkers
        from trainlab.train.supervision.failures import one_line

        # Ray Train gave up restarting lost workers (or an elastic run stayed below
        # its min): the agents could not write this.
        cause = getattr(e, "controller_failure", None)
        if isinstance(cause, TooFewWorkers):
            error = str(cause)
        else:
            error = (
                f"gave up after Ray Train worker failures "
                f"(train.max_failures = {cfg.train.max_failures}): {one_line(e)}"
            )
        summary = failed_summary(job, error)
        summary["lost_nodes"] = lost_nodes(e)  # for a job retry to avoid (train.placement)
        _keep_summary(job, summary)
        _abandon(job, summary)
        raise TrainingFailed(summary) from None
    summary = RunRecords(job.run_dir).read_summary()
    if summary is None:
        raise RuntimeError(f"{job.run_dir}: the run ended without writing run_summary.json")
    if summary.get("status") == RunStatus.FAILED:  # the agents ran out of restarts
        raise TrainingFailed(summary)
    return summary


def _driver_record(loc: RunLocation) -> tuple[str, int, float] | None:
    """This driver's lock record (host, pid, since), which its workers check to
    stop when it is gone (TrainJob.orphaned)."""
    from trainlab.run.holder import current_holder

    holder = current_holder(loc)
    if holder is None or (holder.pid, holder.host) != (os.getpid(), socket.gethostname()):
        return None
    return (holder.host, holder.pid, holder.since)


def _keep_summary(job: TrainJob, summary: dict[str, Any]) -> bool:
    """The driver's summary of a run that ended without one, written to the run;
    when its storage does not take it (an object store's outage, after retries),
    to this node's working copy instead, said in one line: never lost with the
    driver's traceback. Whether the run's storage took it."""
    from trainlab.run.records import SUMMARY

    try:
        RunRecords(job.run_dir).write_summary(summary)
        return True
    except OSError as e:
        local = RunLocation.of(job.run_dir).local / SUMMARY
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        log.error("%s could not be written to the run (%s); it is kept at %s", SUMMARY, e, local)
        return False


def _interrupted(
    job: TrainJob, shutdown: bool = False, store_users: _StoreUsers | None = None
) -> dict[str, Any]:
    """The run's summary when the user stopped it before its training processes
    could (status "interrupted", newest valid checkpoint); with `shutdown`, Ray's
    processes of this driver go too (they end its workers, the training
    processes with them). When the run's storage did not take the summary,
    `store_users` are abandoned: the lease is left to go stale (a resume takes it
    over, recorded) and the logs unshipped, so that the driver ends at once
    instead of waiting on every retry of the store's SDK. Ray's shutdown waits
    for the fit thread to leave `ray.get` (end_fit_then_shutdown)."""
    from trainlab.location.errors import retry_budget

    with retry_budget(INTERRUPT_STORE_WAIT_S):  # a person waits: seconds, not every retry
        summary = interrupted_summary(job)
        records = RunRecords(job.run_dir)
        answered = _keep_summary(job, summary)
        try:
            started = bool(records.attempts())  # a process started: its MLflow run may exist
        except OSError:  # storage that does not answer: close the records, which may exist
            started = True
    if started:
        _abandon(job, summary)
    if store_users is not None and not answered:
        store_users.abandon()
    ray = sys.modules.get("ray")  # a Ctrl-C during `import ray` leaves it half imported
    if shutdown and getattr(ray, "is_initialized", lambda: False)():
        end_fit_then_shutdown(ray)
    return summary


def _remove_refused(loc: RunLocation) -> None:
    """A new run refused before any worker started (a node off its lock, too few
    CPUs) leaves nothing behind: its directory (and, in a store, its objects) goes,
    and the day's folder when it is left empty."""
    import shutil

    shutil.rmtree(loc.local, ignore_errors=True)  # this node's copy of it
    loc.home.delete_tree()  # the run (on a disk: the same folder, gone already)
    loc.home.parent.remove_if_empty()  # the day's folder, unless another run is there


def _abandon(job: TrainJob, summary: dict[str, Any]) -> None:
    """End the run's records kept by callbacks (its workers could not)."""
    from trainlab.train.loop.callbacks import build_callbacks

    try:
        build_callbacks(job.callbacks, job.cfg).on_run_abandoned(job.run_dir, summary)
    except Exception:  # noqa: BLE001 - a tracking outage must not hide the failure summary
        log.exception("could not close the records of %s", job.run_dir)


def _checked_together(cfg: ExperimentConfig) -> DataInfo:
    """The data checks and, for the embedded local cluster, the device check, with
    every problem reported at once (not one per attempt)."""
    problems: list[str] = []
    data = None
    try:
        data = prepare_data(cfg)
    except UserError as e:
        problems += e.lines
    problems += _local_gpu_problems(cfg)
    problems += _component_problems(cfg)
    if problems:
        raise UserError(problems)
    assert data is not None
    return data


def _component_problems(cfg: ExperimentConfig) -> list[str]:
    """Each `train.components` factory built once here, before Ray starts: one that
    cannot be imported or fails when called (`os:system` is a TypeError, a missing
    module an ImportError) would fail the same way on every rank at every restart
    of `train.max_failures`, so it is a problem of the config, said once. (A
    component's hooks are not run here: an error in one during training fails the
    attempt like any other worker error.)"""
    from trainlab.train.loop.components import build_components

    problems = []
    for path in cfg.train.components:
        try:
            build_components([path], cfg)
        except Exception as e:  # noqa: BLE001 - the user's code: any error is theirs
            problems.append(f"train.components: {path!r} failed to build: {type(e).__name__}: {e}")
    return problems


def _local_gpu_problems(cfg: ExperimentConfig) -> list[str]:
    """resource.use_gpu on a machine without enough GPUs, known before Ray starts
    when the run uses the embedded local cluster (RAY_ADDRESS unset)."""
    r = cfg.resource
    if not r.use_gpu or os.environ.get("RAY_ADDRESS"):
        return []
    import torch

    have = torch.cuda.device_count()
    if have >= r.min_workers:
        return []
    return [
        f"resource.use_gpu: this machine has {have} GPU(s), resource.num_workers needs "
        f"{r.min_workers} (set resource.use_gpu: false to train on CPU)"
    ]


def _check_cluster(cfg: ExperimentConfig) -> None:
    import ray

    total = ray.cluster_resources()
    r = cfg.resource
    n = r.min_workers  # an elastic run starts with what Ray can place, at least min
    if r.use_gpu and total.get("GPU", 0) < n:
        raise UserError(
            f"resource.use_gpu: the Ray cluster has {total.get('GPU', 0):g} GPU(s), "
            f"resource.num_workers needs {n}"
        )
    need = r.cpus_per_worker * n
    if total.get("CPU", 0) < need:
        raise UserError(
            f"resource: {n} workers x {r.cpus_per_worker:g} CPU need "
            f"{need:g} CPUs; the Ray cluster has {total.get('CPU', 0):g}"
        )


def _workers_text(cfg: ExperimentConfig) -> str:
    r = cfg.resource
    return f"{r.min_workers}-{r.max_workers}" if r.elastic else str(r.world_size)


def _scaling(cfg: ExperimentConfig) -> dict[str, Any]:
    """ScalingConfig's size: the fixed count, or an elastic run's (min, max) allowed
    sizes (multiples of tp x pp) and how often Ray looks for capacity to grow by."""
    r = cfg.resource
    if not r.elastic:
        return {"num_workers": r.world_size}
    sizes = r.allowed_world_sizes(_group_size(cfg))
    return {
        "num_workers": (min(sizes), max(sizes)),
        "elastic_resize_monitor_interval_s": r.resize_check_s,
    }


def _group_size(cfg: ExperimentConfig) -> int:
    """tp x pp: the workers that only ever come and go together."""
    return (cfg.parallel.tp or 1) * (cfg.parallel.pp or 1)


def _trainer_class(cfg: ExperimentConfig, run_dir: str) -> Any:
    """TorchTrainer; for an elastic run one whose resizes keep tp x pp groups whole,
    skip lost nodes and grow at a checkpoint of the run (trainlab.train.driver.elastic)."""
    if not cfg.resource.elastic:
        from ray.train.torch import TorchTrainer

        return TorchTrainer
    import functools

    from trainlab.train.driver.elastic import ElasticTorchTrainer

    return functools.partial(
        ElasticTorchTrainer,
        unit=_group_size(cfg),
        run_dir=run_dir,
        below_min_wait_s=cfg.resource.below_min_wait_s,
    )


def _check_node_chaos(cfg: ExperimentConfig) -> None:
    """train.chaos.kill_node_at_steps loses a node other than the driver's: the
    cluster must have one (known only now, not at validate)."""
    import ray

    if not cfg.train.chaos.kill_node_at_steps:
        return
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if len(alive) < 2:
        raise UserError(
            f"train.chaos.kill_node_at_steps = {cfg.train.chaos.kill_node_at_steps}: the "
            f"Ray cluster has {len(alive)} node(s), none besides the driver's to lose "
            "(a multi-node cluster: trainlab cluster up --worker-nodes N)"
        )


def _check_smoke(loc: RunLocation, summary: dict[str, Any]) -> dict[str, Any]:
    """The rehearsal passed when a worker was killed, the group resumed from the
    validated checkpoint before the kill, and the run completed."""
    records = RunRecords(loc)
    resumed_from = [a["start_step"] for a in records.attempts()][1:]
    committed = ckpts.catalog(loc).committed()
    checks = {
        "completed": summary.get("status") == RunStatus.COMPLETED,
        "checkpoint_saved_and_validated": bool(committed) and all(i.valid for i in committed),
        "worker_killed_and_restarted": summary.get("restarts", 0) >= 1,
        "resumed_from_checkpoint": SMOKE_CHECKPOINT_EVERY in resumed_from,
    }
    summary = {**summary, "smoke": {"checks": checks, "resumed_from": resumed_from}}
    if not all(checks.values()):
        failed = ", ".join(k for k, ok in checks.items() if not ok)
        summary.update(status=RunStatus.FAILED, error=f"smoke rehearsal failed: {failed}")
        records.write_summary(summary)
        raise TrainingFailed(summary)
    records.write_summary(summary)
    return summary
