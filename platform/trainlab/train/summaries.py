"""A run's summary (run_summary.json), built from a driver's or trainer's job
(a trainlab.train.job.TrainJob) for every outcome: completed, stopped,
interrupted, failed. The records it reads and the file it is written to are
trainlab.run.records (`RunRecords.write_summary`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from trainlab.envlock import run_environment
from trainlab.location import StoreUnavailable
from trainlab.repeats import summary_group
from trainlab.run.records import INTERRUPT_REASON, RunRecords, failure_cause
from trainlab.runstatus import RunStatus

log = logging.getLogger(__name__)


def run_summary(
    job: Any,
    status: str,
    *,
    step: int,
    restarts: int,
    last_checkpoint: Any = None,
    best_checkpoint: Any = None,
    final_loss: float | None = None,
    val_losses: dict[str, float] | None = None,
    weights_sha256: str | None = None,
    start_step: int | None = None,
    throughput: tuple[float | None, float | None] = (None, None),
    stop_reason: str | None = None,
    error: str | None = None,
    peak_memory_bytes: int | None = None,
) -> dict[str, Any]:
    """The run summary of `job` (a trainlab.train.job.TrainJob), built in one place
    for every outcome. Checkpoints are `CheckpointInfo`s (or None)."""
    records = RunRecords(job.location)
    # Storage that does not answer (a store's outage) still gives a summary: what
    # could not be read is left out (it stays in the records, for a later look).
    failures = _or_none(lambda: records.failures(job.session)) or []
    val_losses = dict(val_losses or {})
    val_loss = val_losses.get("all")
    if stop_reason == INTERRUPT_REASON:  # a stop the user asked for with Ctrl-C
        status = RunStatus.INTERRUPTED
    if status == RunStatus.FAILED and best_checkpoint is not None:
        val_loss = best_checkpoint.val_loss  # the evaluation of what a retry resumes
    summary: dict[str, Any] = {
        "name": job.cfg.name,
        "status": status,
        "final_step": step,
        "final_loss": final_loss,
        "val_loss": val_loss,
        # The lowest held-out evaluation a kept checkpoint holds (the trainer adds its
        # own start's evaluations); val_loss is the latest evaluation.
        "best_val_loss": best_checkpoint.val_loss if best_checkpoint else None,
        "tokens_seen": step * job.cfg.tokens_per_step,
        "restarts": restarts,
        "weights_sha256": weights_sha256,
        "last_checkpoint": last_checkpoint.where if last_checkpoint else None,
        "best_checkpoint": best_checkpoint.where if best_checkpoint else None,
        "wall_seconds": round(time.time() - job.started_at, 3),
        "tokens_per_s": throughput[0],
        "tokens_per_s_median": throughput[1],
        "val_losses": val_losses,
        "run_dir": job.run_dir,
        "config_hash": job.config_hash,
        "dataset_fingerprint": job.dataset_fingerprint,
        "start_step": start_step,
        "stop_reason": stop_reason,
        # Max over ranks (device memory on GPU, process RSS on CPU) next to the
        # plan's estimate per device.
        "peak_memory_bytes": peak_memory_bytes,
        "planned_memory_bytes": planned_memory_bytes(job.plan),
        "failures": failures,
    }
    if status == RunStatus.FAILED:
        summary["error"] = error
        summary["failure_cause"] = failure_cause(failures)
    # The software it ran with (trainlab.envlock: the driver's node check wrote it).
    summary["environment"] = run_environment(job.run_dir)
    if summary_group():  # one seed of a `--repeats` group (trainlab.repeats)
        summary["group"] = summary_group()
    extensions = _or_none(records.extensions)
    if extensions:
        summary["extensions"] = extensions
    resizes = _or_none(records.resizes) or []
    if job.elastic or job.cfg.resource.elastic or resizes:
        keys = ("step", "from_world_size", "to_world_size", "reason", "steps_redone", "seconds")
        summary["resizes"] = [{k: r.get(k) for k in keys} for r in resizes]
    return summary


def _or_none(read: Any) -> Any:
    """`read()`, or None when the run's storage does not answer (logged once here)."""
    try:
        return read()
    except (OSError, StoreUnavailable) as e:
        log.warning("left out of the summary: the run's storage did not answer (%s)", e)
        return None


def planned_memory_bytes(plan: dict[str, Any]) -> int | None:
    total = (plan.get("memory_per_device_bytes") or {}).get("total")
    return int(total) if total is not None else None


def interrupted_summary(job: Any) -> dict[str, Any]:
    """The summary of a run the user interrupted before its training processes could
    write one (a Ctrl-C during startup, or a second Ctrl-C): status "interrupted"
    at the newest valid checkpoint, which `--resume` continues from."""
    return _summary_at_newest_checkpoint(job, RunStatus.INTERRUPTED, stop_reason=INTERRUPT_REASON)


def failed_summary(job: Any, error: str) -> dict[str, Any]:
    """The summary of a run that ran out of restarts: every failure with its step,
    rank and error, and the checkpoint a later --run-dir/--resume would use."""
    return _summary_at_newest_checkpoint(job, RunStatus.FAILED, error=error)


def _summary_at_newest_checkpoint(job: Any, status: str, **extra: Any) -> dict[str, Any]:
    """A summary written from the driver, at the run's newest valid checkpoint.
    Storage that does not answer (an object store's outage) still gives one: at
    the last step rank 0 logged, naming no checkpoint and saying why."""
    from trainlab.run import checkpoints as ckpts

    records = RunRecords(job.location)
    try:
        catalog = ckpts.catalog(job.location)
        newest = catalog.find_resume(require_valid=job.cfg.train.checkpoint.validate)
        best = ckpts.best(catalog.committed())
        restarts = records.restarts()
    except (OSError, StoreUnavailable) as e:
        log.error("the run's storage did not answer (%s): the summary names no checkpoint", e)
        why = f"its storage did not answer ({e}): the newest checkpoint is not known"
        error = extra.pop("error", None)
        summary = run_summary(
            job,
            status,
            step=0,
            restarts=0,
            error=f"{error}; {why}" if error else why,
            **extra,
        )
        summary["checkpoint_unknown"] = True  # not "none": it could not be looked at
        return summary
    return run_summary(
        job,
        status,
        step=newest.step if newest else 0,
        restarts=restarts,
        last_checkpoint=newest,
        best_checkpoint=best,
        **extra,
    )
