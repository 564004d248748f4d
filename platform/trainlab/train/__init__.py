"""The execution layer: runs what the config and plan say on Ray Train.

`run(cfg, ...)` is the one entry point (the CLI, trainers/pretrain.py and the
demo call it); see trainlab.train.launcher. Importing this package stays
light: torch and Ray load only when a run starts.

From the driver to the step:

    launcher      checks, run directory, TrainJob, Ray Train (driver)
    worker        Ray Train's per-worker function: loader, callbacks, the agent
    agent         supervises this rank's training process, restarts it in place
    protocol      the typed pipe protocol between a training process and its agent
    child         a training process: process group, then the trainer
    trainer       fit / train_step / evaluate over the TrainState
    state         the stateful parts: model+optimizer, progress, data position, RNG
    step          the loss and one optimizer step (pure functions)
    checkpointer  the TrainState in and out of checkpoints (both formats)
    checkpoint    the disk protocol: atomic commits, checksums, retention
    records       run_summary.json, failures, attempts, progress: one writer each
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainlab.train.launcher import TrainingFailed


def run(cfg: Any, **kwargs: Any) -> dict[str, Any]:
    """Train `cfg` on Ray Train and return its run summary (see launcher.run)."""
    from trainlab.train.launcher import run as _run

    return _run(cfg, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "TrainingFailed":
        from trainlab.train.launcher import TrainingFailed

        return TrainingFailed
    raise AttributeError(name)


__all__ = ["TrainingFailed", "run"]
