"""Recording failures of Ray Train workers (agents) for the failure summary.

Failures of training processes are recorded by their agents
(trainlab.train.supervision.agent). When an agent itself dies (its node is lost, the
actor is killed), Ray Train's controller calls `FailureRecorder.after_exception`
before restarting the group; each such failure becomes lines of
`logs/failures.jsonl` (one per rank, one event) with the step of the newest
logged step (logs/progress.json), the rank and the error.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ray.train import UserCallback

from trainlab.run.records import Failure, RunRecords


def one_line(error: BaseException) -> str:
    """The most telling line of an error, which Ray wraps in several layers."""
    text = str(error).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if "failed at step" in ln:
            return ln[ln.index("rank ") :] if "rank " in ln else ln
    for ln in reversed(lines):
        if not ln.startswith(("File ", "Traceback", "^", "~")):
            return f"{type(error).__name__}: {ln}"[:500]
    return type(error).__name__


class FailureRecorder(UserCallback):
    """Runs in Ray Train's controller; records agent failures (see module doc)."""

    def __init__(self, run_dir: str, session: str):
        self.run_dir, self.session = run_dir, session

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        records = RunRecords(self.run_dir)
        step = records.last_logged_step()
        event = f"ray-{uuid.uuid4().hex[:8]}"
        now = time.time()
        records.add_failures(
            *(
                Failure(
                    self.session,
                    event,
                    rank,
                    step,
                    f"Ray Train worker lost: {one_line(error)}",
                    "lost",
                    time=now,
                )
                for rank, error in sorted(worker_exceptions.items())
            )
        )
