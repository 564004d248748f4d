"""The execution layer: runs what the config and plan say on Ray Train.

`run(cfg, ...)` is the one entry point (the CLI, trainers/pretrain.py and the
demo call it); see trainlab.train.driver.launcher. Importing this package stays
light: torch and Ray load only when a run starts.

The execution layer by role, from the driver to the step (each sub-package
imports only those listed after it: tests/unit/test_import_graph.py; what
belongs to a run on its storage, its directory, lock and records, is
trainlab.run, below this package):

    driver/        launcher (checks, run directory and its lock, TrainJob, Ray
                   Train), worker (Ray Train's per-worker function), placement,
                   interrupt
    supervision/   agent (supervises this rank's training process, restarts it
                   in place), child (a training process: process group, then the
                   trainer), protocol (the pipe between them), failures, logs
    loop/          trainer (fit: batch, step, components), components (P0 guard,
                   chaos, metrics log, evaluator, checkpointing), protocol (the
                   typed Loop its components get), callbacks (rank
                   0's side effects), state (the stateful parts), step (the loss
                   and one optimizer step), checkpointer (the state in and out of
                   DCP checkpoints), metrics, schedule, rng
    summaries      run_summary.json's content, built from a job for every outcome
    job            what the driver hands every worker (TrainJob)
    parallel/      the techniques applied from outside (FSDP/replicate, tensor,
                   pipeline, recomputation), the mesh and the process groups
    checkpoint/    disk (the atomic commit), writer (one rank's saves, async),
                   faults; a checkpoint's names, record, validation, catalog
                   and retention, and the object-storage form (per-rank parts,
                   commit marker) are trainlab.run.checkpoints
    memtrace       the planner's check: one real step on fake tensors
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainlab.train.driver.launcher import TrainingFailed


def run(cfg: Any, **kwargs: Any) -> dict[str, Any]:
    """Train `cfg` on Ray Train and return its run summary (see launcher.run)."""
    from trainlab.train.driver.launcher import run as _run

    return _run(cfg, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "TrainingFailed":
        from trainlab.train.driver.launcher import TrainingFailed

        return TrainingFailed
    raise AttributeError(name)


__all__ = ["TrainingFailed", "run"]
