"""Faults of the run's storage, and a worker group that must not commit: what
ends a save (and the attempt) instead of being retried in place."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

# How a fault of the run's storage is named in records (the OS's text otherwise).
FAULT_TEXT = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EIO: "I/O error",
    errno.EROFS: "read-only file system",
}


class Orphaned(RuntimeError):
    """This worker group's driver is gone (killed) or another driver holds the run
    now: the group must not commit anything more (trainlab.run.lock
    `orphaned`); its agents end it without a restart."""


class StorageFault(Exception):
    """A write of the run's storage failed (disk full, quota, I/O error, a folder
    gone): the attempt ends as failed with this cause, never restarted in place,
    since the same write would fail again (trainlab.train.loop.trainer records it).
    `what`: the write ("saving step 20"); `step`: the checkpoint's step, if one."""

    def __init__(self, what: str, error: OSError, step: int | None = None):
        self.what, self.error, self.step = what, error, step
        self.cause = f"{fault_text(error)} while {what}"  # the trainer adds where to resume
        super().__init__(self.cause)


# A write that fails with these means the run's storage will not take it (full, a
# quota, a read-only or failing disk): the same write fails again, wherever it came
# from (a checkpoint, a record, a component's or a callback's own file).
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})


def storage_error_in(error: BaseException, run_path: Path) -> OSError | None:
    """The OSError behind `error` when it is a fault of the run's storage: one of
    STORAGE_ERRNOS, a store's refusal (trainlab.location Refused), or no permission
    on a file inside the run's directory `run_path` (a read-only logs/). None for
    any other error, which a restart may get past."""
    from trainlab.location.errors import Refused

    found = os_error_in(error)
    if found is None:
        return None
    if isinstance(found, Refused) or found.errno in STORAGE_ERRNOS:
        return found
    if found.errno in (errno.EACCES, errno.EPERM) and found.filename:
        with contextlib.suppress(ValueError, OSError):
            Path(os.path.abspath(found.filename)).relative_to(os.path.abspath(run_path))
            return found
    return None


def fault_text(error: OSError) -> str:
    """A fault's cause in words: `no space left on device`, else the OS's text."""
    if error.errno in FAULT_TEXT:
        return FAULT_TEXT[error.errno]
    text = error.strerror or str(error) or type(error).__name__
    return f"{text[:1].lower()}{text[1:]}" + (f": {error.filename}" if error.filename else "")


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind `error`: itself, its cause or context, or one rank's
    failure inside a torch.distributed.checkpoint CheckpointException."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, StorageFault):
            return e.error
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)  # DCP: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            for wrapped in failures.values():
                todo.append(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
        todo += [e.__cause__, e.__context__]
    return None


def first_line_of(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
