"""The run lock's record, `{run}/.lock.json`: who holds a run (host, pid, since)
and their newest beat. The driver's lock writes it (trainlab.run.lock);
its workers read it to stop when their driver is gone (`orphaned`: the agents,
and rank 0 right before each commit); `gc` reads it to leave a live run alone.
Below the driver and the loop, so both read it without importing each other."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from trainlab.run.location import RunLocation

HOLDER = ".lock.json"
DEFAULT_BEAT_S = 30.0
MISSED_BEATS = 4


def beat_s() -> float:
    """How often a holder rewrites its beat (the MLflow heartbeat's setting)."""
    return float(os.environ.get("TRAINLAB_HEARTBEAT_S") or DEFAULT_BEAT_S)


def stale_after_s() -> float:
    """How old a beat from another host is when its holder counts as gone."""
    return float(os.environ.get("TRAINLAB_LOST_AFTER_S") or MISSED_BEATS * beat_s())


@dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a run directory's lock."""

    host: str
    pid: int
    since: float  # epoch seconds the lock was taken
    beat: float  # epoch seconds of the holder's newest beat

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host} since {when}"

    def on_this_host(self) -> bool:
        return self.host == socket.gethostname()

    def fresh(self, now: float | None = None) -> bool:
        return (now or time.time()) - self.beat <= stale_after_s()


def parse_holder(text: str | None) -> Holder | None:
    try:
        d = json.loads(text or "")
        return Holder(str(d["host"]), int(d["pid"]), float(d["since"]), float(d["beat"]))
    except (ValueError, KeyError, TypeError):
        return None


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


def pid_running(pid: int) -> bool:
    """Whether process `pid` runs on this host: a killed process its parent has
    not reaped yet (a zombie) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: the signal said it exists
    return stat.rpartition(")")[2].split()[:1] != ["Z"]
