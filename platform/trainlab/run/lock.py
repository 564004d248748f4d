"""One writer per run directory: the driver's lock on it.

    {run_dir}/.lock            an OS file lock (flock), held by the driver process
                               of `trainlab train` (or of the `ray job` entrypoint)
                               from before it writes anything into the run
                               directory until it ends; the OS drops it when the
                               process dies, however it dies
    {run_dir}/.lock.json       who holds it: host, pid, since, and a beat the
                               holder rewrites every TRAINLAB_HEARTBEAT_S (default
                               30 s), for readers on another host, whose flock a
                               shared filesystem may not show
    {run_dir}/logs/lock.jsonl  each stale lock taken over: whose, and when

A second writer (`--resume` of a running run, a job retry overlapping its
previous attempt) is refused with `RunLockHeld` (exit 2) naming the holder.
A lock whose holder is gone (the flock is free; on another host, the beat is
older than TRAINLAB_LOST_AFTER_S, default 4 beats) is stale: it is taken over
and the takeover recorded. `trainlab gc` asks `live_holder` and never touches a
run that has one. Ray's workers never take the lock: only the driver writes
run-level state, and it outlives its workers.

The `.lock` file is never deleted while the run directory exists: deleting it
would let a second process lock a new file while the first holds the old one.
Its descriptor is not inherited across exec (Python's default), so Ray's
processes that the driver starts do not keep a dead driver's lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trainlab.errors import UserError
from trainlab.exitcodes import INFRASTRUCTURE
from trainlab.fileutil import write_text_atomic
from trainlab.location import Conflict
from trainlab.run.holder import (
    HOLDER,
    Holder,
    beat_s,
    parse_holder,
    pid_running,
)
from trainlab.run.location import RunLocation

log = logging.getLogger(__name__)

LOCK = ".lock"
TAKEOVERS = "logs/lock.jsonl"
UNKNOWN_HOLDER = "a process that has not said who it is yet"


class RunLockHeld(UserError):
    """Another live process holds the run directory's lock."""

    def __init__(self, run_dir: Path | str, holder: Holder | None):
        who = holder.describe() if holder else UNKNOWN_HOLDER
        super().__init__(
            f"{run_dir}: in use by another trainlab process ({who}); a run has one "
            "writer: wait for it to end, or stop it first"
        )
        self.holder = holder


def read_holder(run_dir: Path) -> Holder | None:
    """The holder `.lock.json` names (a live one, or a dead one that never released),
    or None when there is none or it cannot be read."""
    try:
        d = json.loads((run_dir / HOLDER).read_text())
        return Holder(str(d["host"]), int(d["pid"]), float(d["since"]), float(d["beat"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _remote_and_fresh(holder: Holder | None) -> bool:
    """A holder on another host that beat recently: alive as far as this host can
    tell, whatever flock says here (a shared filesystem may not carry the lock)."""
    return holder is not None and not holder.on_this_host() and holder.fresh()


class RunLock:
    """The lock of one run directory, held by this process; `release` (or leaving
    the `with` block, or the process ending) gives it up."""

    def __init__(self, run_dir: Path, fd: int, holder: Holder):
        self.run_dir, self.holder = run_dir, holder
        self._fd: int | None = fd
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat_loop, name="trainlab-runlock", daemon=True
        )

    @classmethod
    def acquire(cls, run_dir: str | Path | RunLocation) -> RunLock | StoreRunLock:
        """Take `run_dir`'s lock (creating the directory), or raise RunLockHeld
        naming its live holder. A stale lock is taken over and recorded. A run in
        object storage gets a `StoreRunLock`."""
        if isinstance(run_dir, RunLocation):
            if run_dir.remote:
                return StoreRunLock.acquire(run_dir)
            run_dir = run_dir.local
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _try_flock(fd):
                raise RunLockHeld(run_dir, read_holder(run_dir))
            previous = read_holder(run_dir)  # a holder that ended without releasing
            if _remote_and_fresh(previous):
                raise RunLockHeld(run_dir, previous)
        except BaseException:
            os.close(fd)  # drops the flock with it
            raise
        now = time.time()
        lock = cls(run_dir, fd, Holder(socket.gethostname(), os.getpid(), now, now))
        lock._write_holder()
        if previous is not None:
            lock._record_takeover(previous)
        lock._thread.start()
        return lock

    def release(self) -> None:
        """Stop beating, say nobody holds it, drop the flock. Idempotent."""
        if self._fd is None:
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            (self.run_dir / HOLDER).unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def abandon(self) -> None:
        """Nothing to give up: releasing a lock on this machine's disk waits on no
        network (StoreRunLock.abandon)."""

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _write_holder(self) -> None:
        write_text_atomic(self.run_dir / HOLDER, json.dumps(asdict(self.holder)) + "\n")

    def _beat_loop(self) -> None:
        while not self._stop.wait(beat_s()):
            self.holder = Holder(**{**asdict(self.holder), "beat": time.time()})
            try:
                self._write_holder()
            except OSError as e:  # a vanished directory: the run's own writes will say so
                log.warning("could not renew the lock record of %s: %s", self.run_dir, e)

    def _record_takeover(self, previous: Holder) -> None:
        record = {
            "time": time.time(),
            "host": self.holder.host,
            "pid": self.holder.pid,
            "took_over_from": asdict(previous),
        }
        log.warning(
            "%s: took over the lock of %s, which ended without releasing it",
            self.run_dir,
            previous.describe(),
        )
        try:
            path = self.run_dir / TAKEOVERS
            path.parent.mkdir(exist_ok=True)
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            log.warning("could not record the lock takeover in %s: %s", self.run_dir, e)


class StoreRunLock:
    """The lock of a run in object storage: a lease, `.lock.json` in the run's
    prefix, naming its holder and renewed every beat. A store has no file locks,
    so a holder counts as alive while its beat is fresh (TRAINLAB_LOST_AFTER_S),
    or, on this host, while its process runs.

    Where the store has conditional writes (S3: If-None-Match / If-Match;
    `Location.conditional_writes`), taking the lease is one compare-and-swap:
    created only if absent, or replaced only if still at the stale holder's
    version, so of two drivers exactly one wins however slow either's request
    is. Every beat is conditional on the version this holder wrote last: a beat
    that finds another holder (the lease was taken over while this driver could
    not reach the store) calls `on_lost`, which by default ends this driver at
    once (`lost_lease`: exit 75, nothing more written; Ray ends its workers with
    their job), so no two drivers train one run past one beat.

    Without conditional writes (the GCS emulator here), taking it writes this
    process's record and reads it back after a pause (TRAINLAB_LOCK_SETTLE_S,
    default 1 s): of two drivers starting within that pause, the one whose record
    is read back wins; a write slower than the pause can still admit two."""

    def __init__(self, loc: RunLocation, holder: Holder, on_lost: Any = None):
        self.loc, self.holder = loc, holder
        self.version: str | None = None  # what this holder wrote last (conditional)
        self.on_lost = on_lost or lost_lease
        self._released = False
        self._abandoned = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat_loop, name="trainlab-runlock", daemon=True
        )

    @classmethod
    def acquire(cls, loc: RunLocation, on_lost: Any = None) -> StoreRunLock:
        now = time.time()
        lock = cls(loc, Holder(socket.gethostname(), os.getpid(), now, now), on_lost)
        previous = lock._take() if loc.home.conditional_writes else lock._take_settled()
        if previous is not None:
            log.warning(
                "%s: took over the lock of %s, which ended without releasing it",
                loc.uri,
                previous.describe(),
            )
            loc.append_jsonl(
                TAKEOVERS,
                [{"time": now, "host": lock.holder.host, "pid": lock.holder.pid,
                  "took_over_from": asdict(previous)}],
            )  # fmt: skip
        lock._thread.start()
        return lock

    def _take(self) -> Holder | None:
        """The lease by compare-and-swap; the stale holder it replaced, if any."""
        got = self.loc.home.read_versioned(HOLDER)
        previous = parse_holder(got[0].decode(errors="replace")) if got else None
        if previous is not None and _alive(previous):
            raise RunLockHeld(self.loc.uri, previous)
        try:
            self.version = self.loc.home.write_if(HOLDER, self._record(), got[1] if got else None)
        except Conflict:
            raise RunLockHeld(self.loc.uri, parse_holder(self.loc.read_text(HOLDER))) from None
        return previous

    def _take_settled(self) -> Holder | None:
        """The lease by write, pause, read back (no conditional writes)."""
        previous = parse_holder(self.loc.read_text(HOLDER))
        if previous is not None and _alive(previous):
            raise RunLockHeld(self.loc.uri, previous)
        self._write()
        time.sleep(float(os.environ.get("TRAINLAB_LOCK_SETTLE_S") or 1.0))
        back = parse_holder(self.loc.read_text(HOLDER))
        if back != self.holder:
            raise RunLockHeld(self.loc.uri, back)
        return previous

    def _record(self) -> bytes:
        return (json.dumps(asdict(self.holder)) + "\n").encode()

    def _write(self) -> None:
        self.loc.write_text(HOLDER, self._record().decode())

    def beat(self) -> bool:
        """Renew the lease now; False (after `on_lost`) when another holder has it."""
        self.holder = Holder(**{**asdict(self.holder), "beat": time.time()})
        if self.version is None:
            self._write()
            return True
        try:
            self.version = self.loc.home.write_if(HOLDER, self._record(), self.version)
        except Conflict:
            got = self.loc.home.read_versioned(HOLDER)
            holder = parse_holder(got[0].decode(errors="replace")) if got else None
            mine = (self.holder.host, self.holder.pid, self.holder.since)
            if got and holder and (holder.host, holder.pid, holder.since) == mine:
                # an earlier beat that landed while its answer was lost (an outage)
                self.version = got[1]
                return True
            self._stop.set()
            self.on_lost(self.loc.uri, holder)
            return False
        return True

    def _beat_loop(self) -> None:
        while not self._stop.wait(beat_s()):
            try:
                if not self.beat():
                    return
            except OSError as e:
                log.warning("could not renew the lock record of %s: %s", self.loc.uri, e)

    def release(self) -> None:
        """Stop beating and remove the record if it is still this holder's. Idempotent."""
        if self._released:
            return
        self._released = True
        self._stop.set()
        if self._abandoned:
            return
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            if parse_holder(self.loc.read_text(HOLDER)) == self.holder:
                self.loc.delete(HOLDER)

    def abandon(self) -> None:
        """The store does not answer and this driver is ending: stop beating, and
        let `release` send nothing more (no wait for a beat inside an unanswered
        request, no removal of the record). The lease goes stale; a resume takes
        it over, recorded in the run's takeovers."""
        self._abandoned = True
        self._stop.set()

    def __enter__(self) -> StoreRunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


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


def _alive(holder: Holder) -> bool:
    """A holder of a store lease is alive: its process runs (on this host), or
    its beat is fresh (on another)."""
    if holder.on_this_host() and not pid_running(holder.pid):
        return False
    return holder.fresh()


def live_holder(run_dir: str | Path) -> str | None:
    """Who holds `run_dir`'s lock ("pid N on host H since T") when a live process
    does, else None. Changes nothing: a free flock is taken and dropped at once."""
    run_dir = Path(run_dir)
    holder = read_holder(run_dir)
    try:
        fd = os.open(run_dir / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        fd = None
    if fd is not None:
        try:
            if not _try_flock(fd):
                return holder.describe() if holder else UNKNOWN_HOLDER
        finally:
            os.close(fd)
    return holder.describe() if _remote_and_fresh(holder) else None


@contextlib.contextmanager
def held_quietly(run_dir: str | Path) -> Iterator[bool]:
    """Hold `run_dir`'s flock for a moment (gc deleting it), without a holder
    record or beat; yields False, holding nothing, when a live process has it."""
    path = Path(run_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        yield True
        return
    try:
        yield _try_flock(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def kept_still(run: RunLocation) -> Iterator[str | None]:
    """`trainlab gc` reading or deleting a run: yields None when no live process
    holds it (gc may go on), else who does ("pid N on host H since T"), and gc
    leaves it alone. On a disk the run's flock is held meanwhile, so a start in
    between is refused; in a store, where there is no lock to hold, the lease is
    read (again right before gc deletes; docs/training.md)."""
    if run.remote:
        holder = parse_holder(run.read_text(HOLDER))
        yield holder.describe() if holder is not None and _alive(holder) else None
        return
    holder = live_holder(run.local)
    with held_quietly(run.local) as held:
        yield holder if holder is not None else (None if held else UNKNOWN_HOLDER)
