"""`Loop`: the training loop as its components see it (the typed interface of
`trainlab.train.loop.trainer.Trainer` that `Component` hooks get).

A component (`train.components`, trainlab.train.loop.components) is handed the
loop at every hook. This Protocol names what it may read and call, with types,
so a component author sees the contract here rather than in the Trainer's
code; tests/unit/train/test_loop_protocol.py checks that the Trainer has every
member (a rename in one is a test failure, not a component's AttributeError
mid-run).

Read-mostly: a component decides from agreed values (`step`, `last_signals`,
`cfg`) and acts through `request_stop`, checkpoints (`checkpointer`) and rank
0's callbacks; the counters below it (`stop`, `stop_signal`, `stop_reason`,
`stopped_at`) belong to the built-in components.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

    from trainlab.config.schema import ExperimentConfig
    from trainlab.run import checkpoints as ckpts
    from trainlab.run.records import RunRecords
    from trainlab.train.job import TrainJob
    from trainlab.train.loop.callbacks import Callback
    from trainlab.train.loop.checkpointer import Checkpointer
    from trainlab.train.loop.metrics import Meter, P0Rules, StepSignals
    from trainlab.train.loop.state import TrainState
    from trainlab.train.loop.stream import StreamLoader
    from trainlab.train.parallel.distributed import DistEnv


class Loop(Protocol):
    """What every hook of a `Component` gets (the Trainer, on every rank)."""

    # What runs, and where
    cfg: ExperimentConfig
    job: TrainJob
    env: DistEnv  # this rank: rank, world size, device, collectives
    state: TrainState  # model, optimizer, scheduler, progress, data position
    loader: StreamLoader  # the run's data stream (batches by global step)
    records: RunRecords  # the run's records, wherever it lives
    callbacks: Callback  # rank 0's callbacks (MLflow, alerts); a no-op list elsewhere
    report: Callable[[dict[str, Any]], None] | None  # Ray Train's report, if in Ray

    # The built-in components and their state (typed by name only: the components'
    # module imports this one, trainlab.train.loop.components)
    components: list[Any]  # every Component, in the order they act
    guard: Any  # P0Guard: the P0 rules' action
    evaluator: Any  # Evaluator: held-out loss
    saver: Any  # Checkpointing: when to save, delivering finished checkpoints
    growth: Any  # GrowthHold (trainlab.train.loop.growth): an elastic run's hold
    checkpointer: Checkpointer
    meter: Meter
    p0_rules: P0Rules

    # What the loop knows so far
    start_step: int
    restarts: int
    last_signals: StepSignals  # the newest step's agreed health signals
    last_loss: float | None
    last_checkpoint: ckpts.CheckpointInfo | None
    checkpoints: list[ckpts.CheckpointInfo]

    # Stopping (the built-in components' counters; a component calls request_stop)
    stop: int
    stop_signal: int
    stop_reason: str
    stopped_at: int | None

    @property
    def step(self) -> int:
        """Optimizer steps done (a hook at step s sees s after step s's update)."""
        ...

    @property
    def model(self) -> nn.Module:
        """The model being trained (wrapped as its parallel layout wraps it)."""
        ...

    def request_stop(self, reason: str, save: bool = True) -> None:
        """Stop at this step, with a checkpoint unless `save` is False: call it on
        every rank at the same step."""
        ...

    def stop_request(self) -> int:
        """Rank 0's stop request at this step (a Ctrl-C, a callback), before ranks agree."""
        ...

    def evaluate(self) -> dict[str, float]:
        """Held-out loss per source and "all" (a collective: every rank calls it)."""
        ...
