"""The run lock's record, `{run}/.lock.json`: who holds a run (host, pid, since)
and their newest beat. The driver's lease writes it (trainlab.run.lock, over
trainlab.location.lease); its workers read it to stop when their driver is gone
(`orphaned`: the agents, and rank 0 right before each commit); `gc` reads it to
leave a live run alone. Below the driver and the loop, so both read it without
importing each other."""

from __future__ import annotations

from trainlab.location.lease import RECORD, Holder, parse_holder, pid_running
from trainlab.run.location import RunLocation

__all__ = ["HOLDER", "Holder", "current_holder", "orphaned", "parse_holder", "pid_running"]

HOLDER = RECORD  # {run}/.lock.json: the lease's record (trainlab.location.lease)


def current_holder(loc: RunLocation) -> Holder | None:
    """The run's lock record as it is now (None when there is none or it does not parse)."""
    return parse_holder(loc.read_text(HOLDER))


def orphaned(loc: RunLocation, driver: tuple[str, int, float]) -> str | None:
    """Why the worker group started by `driver` (host, pid, since: its lock record
    when it started the group) must stop, or None while that driver holds the run:
    another driver holds it now (a takeover after this one's lease went stale), or
    the driver ran on this host and its process is gone (killed). A record that
    cannot be read, or none (the driver released it after its workers ended),
    says nothing: None."""
    try:
        holder = current_holder(loc)
    except OSError:
        return None
    if holder is None:
        return None
    if (holder.host, holder.pid, holder.since) != tuple(driver):
        return f"another driver holds the run now ({holder.describe()})"
    if holder.on_this_host() and not pid_running(holder.pid):
        return f"its driver (pid {holder.pid} on this host) is gone"
    return None
