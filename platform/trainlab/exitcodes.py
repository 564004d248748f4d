"""Process exit codes of trainlab commands, one table for the CLI, the job
wrapper and `submit` (docs/training.md, "Failures", lists them for users).

- 0  done (also: a completed run asked to resume, left untouched)
- 1  an error that would happen again (code, numerics outside an alert's action)
- 2  bad input: config, data, files, flags; nothing was started
- 4  stopped by an alert's action (`tracking.alerts.on_p0: checkpoint_and_stop`):
     deliberate, never retried
- 74 the run's storage failed a write (EX_IOERR: disk full, quota, I/O error) while
     saving a checkpoint or a record: the run ended as failed with the cause, its
     partial checkpoint removed; free space (or fix the disk), then resume. Not
     retried by a job retry: the same write would fail again
- 75 the cluster lost processes or workers the run needed (EX_TEMPFAIL): a retry may succeed
- 130 interrupted by the user (Ctrl-C / SIGINT): resume with the printed command
- 143 stopped by SIGTERM (a scheduler, Kubernetes, a job runner): the same graceful
     stop as Ctrl-C (at the next step, with a checkpoint when due); resume with the
     printed command
"""

from __future__ import annotations

OK = 0
ERROR = 1
BAD_INPUT = 2
STOPPED_BY_ALERT = 4
STORAGE_FAULT = 74
INFRASTRUCTURE = 75
INTERRUPTED = 130
TERMINATED = 143  # 128 + SIGTERM
