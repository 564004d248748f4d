"""One writer per run: the driver's lease on its run, wherever the run is.

    {run}/.lock                on a disk: the lease's OS file lock (flock)
    {run}/.lock.json           who holds it: host, pid, since, and a beat
    {run}/logs/lock.jsonl      each stale lease taken over: whose, and when

The lease itself is trainlab.location.lease (`Location.lease`): on a disk an OS
file lock plus its record, in an object store the record as a lease renewed
every beat. The driver of `trainlab train` (or of the `ray job` entrypoint)
holds it from before it writes anything into the run until it ends. A second
writer (`--resume` of a running run, a job retry overlapping its previous
attempt) is refused with `RunLockHeld` (exit 2) naming the holder. A lease whose
holder is gone is taken over and the takeover recorded. A driver whose lease in
a store was taken over while it could not renew it ends at once (`lost_lease`).
`trainlab gc` keeps a run still (`kept_still`) and never touches a run that has a
live holder. Ray's workers never take the lease: only the driver writes
run-level state, and it outlives its workers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path

from trainlab.errors import UserError
from trainlab.exitcodes import INFRASTRUCTURE
from trainlab.location.lease import (
    LOCK,
    UNKNOWN_HOLDER,
    Held,
    Holder,
    Lease,
    disk_holder,
    read_record,
)
from trainlab.run.holder import HOLDER
from trainlab.run.location import RunLocation

__all__ = [
    "HOLDER",
    "LOCK",
    "TAKEOVERS",
    "RunLock",
    "RunLockHeld",
    "kept_still",
    "live_holder",
    "lost_lease",
    "read_holder",
]

log = logging.getLogger(__name__)

TAKEOVERS = "logs/lock.jsonl"


class RunLockHeld(UserError):
    """Another live process holds the run's lease."""

    def __init__(self, run_dir: Path | str, holder: Holder | None):
        who = holder.describe() if holder else UNKNOWN_HOLDER
        super().__init__(
            f"{run_dir}: in use by another trainlab process ({who}); a run has one "
            "writer: wait for it to end, or stop it first"
        )
        self.holder = holder


class RunLock:
    """The run's lease, taken by its driver."""

    @staticmethod
    def acquire(
        run_dir: str | Path | RunLocation,
        on_lost: Callable[[str, Holder | None], None] | None = None,
    ) -> Lease:
        """Take the lease of the run at `run_dir` (a run directory on a disk is made
        when missing), or raise RunLockHeld naming its live holder. A stale lease is
        taken over and recorded. `on_lost`: what a lease in a store does when a beat
        finds another holder (default `lost_lease`: this driver ends)."""
        loc = run_dir if isinstance(run_dir, RunLocation) else RunLocation.of(run_dir)
        try:
            lease = loc.home.lease(on_lost or lost_lease)
        except Held as e:
            raise RunLockHeld(loc.uri, e.holder) from None
        if lease.previous is not None:
            _record_takeover(loc, lease.holder, lease.previous)
        return lease


def _record_takeover(loc: RunLocation, holder: Holder, previous: Holder) -> None:
    log.warning(
        "%s: took over the lock of %s, which ended without releasing it",
        loc.uri,
        previous.describe(),
    )
    record = {"time": holder.since, "host": holder.host, "pid": holder.pid,
              "took_over_from": asdict(previous)}  # fmt: skip
    try:
        loc.append_jsonl(TAKEOVERS, [record])
    except OSError as e:
        log.warning("could not record the lock takeover in %s: %s", loc.uri, e)


def lost_lease(uri: str, holder: Holder | None) -> None:
    """A driver whose lease another took (it could not renew it for
    TRAINLAB_LOST_AFTER_S): it ends at once, writing nothing more to the run, so
    one driver trains it; Ray ends the job's workers with it. Exit 75: a job retry
    finds the lease held and is refused."""
    who = holder.describe() if holder is not None else "another driver"
    log.error(
        "%s: the run's lease was taken over by %s while this driver could not renew it; "
        "stopping this driver now, writing nothing more (the other one trains the run)",
        uri,
        who,
    )
    logging.shutdown()
    os._exit(INFRASTRUCTURE)


def read_holder(run_dir: str | Path) -> Holder | None:
    """The holder a run directory's record names (a live one, or a dead one that
    never released), or None when there is none or it cannot be read."""
    return read_record(Path(run_dir))


def live_holder(run_dir: str | Path) -> str | None:
    """Who holds a run directory's lease ("pid N on host H since T") when a live
    process does, else None. Changes nothing."""
    return disk_holder(Path(run_dir))


def kept_still(run: RunLocation) -> AbstractContextManager[str | None]:
    """`trainlab gc` reading or deleting a run: yields None when no live process
    holds it (gc may go on), else who does ("pid N on host H since T"), and gc
    leaves it alone. On a disk the run's flock is held meanwhile, so a start in
    between is refused; in a store, where there is no lock to hold, the lease is
    read (again right before gc deletes; docs/training.md)."""
    return run.home.kept_still()
