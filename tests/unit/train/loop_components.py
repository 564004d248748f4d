"""A loop component for tests/unit/train/test_components.py, loaded by import path
(`train.components: ["tests.unit.train.loop_components:stop_after_four"]`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainlab.train.loop.components import Component


class StopAfter(Component):
    """Records the steps it saw on each rank; stops the run (with a checkpoint) at
    `at`, deciding from the step alone, so every rank agrees."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, []

    def after_step(self, loop: Any, step: int) -> None:
        self.seen.append(step)

    def at_step_end(self, loop: Any, step: int, last: bool) -> None:
        out = Path(loop.job.run_dir) / "logs" / f"component-rank{loop.env.rank}.json"
        out.write_text(json.dumps(self.seen))
        if step == self.at:
            loop.request_stop(f"the test component stops at step {step}")


def stop_after_four(cfg: Any) -> list[Component]:
    return [StopAfter(4)]


class AskGrowth(Component):
    """Plays Ray Train's controller of an elastic run (tests/unit/train/test_growth.py):
    at step `at`, rank 0 writes a request for a checkpoint to grow at."""

    def __init__(self, at: int) -> None:
        self.at = at

    def at_step_end(self, loop: Any, step: int, last: bool) -> None:
        if step == self.at and loop.env.is_main:
            loop.records.request_growth(2)


def ask_growth_at_three(cfg: Any) -> list[Component]:
    return [AskGrowth(3)]
