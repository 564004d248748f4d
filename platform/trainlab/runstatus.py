"""How a run ended: the one declaration of run statuses.

`run_summary.json`'s `status`, the MLflow `status` tag, `trainlab runs`,
`compare` and `gc --status` all use these values. A `StrEnum`: each member is
its string ("completed"), so JSON and comparisons with plain strings read as
before.
"""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    COMPLETED = "completed"  # train.total_steps reached
    STOPPED = "stopped"  # a callback or `trainlab stop` asked
    STOPPED_BY_ALERT = "stopped_by_alert"  # a P0 alert's checkpoint_and_stop (exit 4)
    INTERRUPTED = "interrupted"  # Ctrl-C; `train RUN_DIR --resume` continues it
    FAILED = "failed"  # then `error`, `failures` and `failure_cause`
    LOST = "lost"  # its processes vanished (no heartbeat); ended by the next command

    @property
    def ended_by_the_run(self) -> bool:
        """Whether the run's own processes wrote this status (LOST is written by
        another command after they vanished)."""
        return self is not RunStatus.LOST


# The statuses a run's own processes end it with.
FINAL_STATUSES = frozenset(s for s in RunStatus if s.ended_by_the_run)
