"""A lease: one holder of a place at a time (a run's one writer), on every
backend. `Location.lease` takes it, `Location.kept_still` reads it for a
moment; the backend picks how (`LocalDisk.lease_kind`):

    {place}/.lock        on a disk: an OS file lock (flock) held by the holder's
                         process until it ends; the OS drops it when the process
                         dies, however it dies
    {place}/.lock.json   who holds it: host, pid, since, and a beat the holder
                         rewrites every TRAINLAB_HEARTBEAT_S (default 30 s), for
                         readers on another host (a shared filesystem may not
                         carry the flock) and for a store, which has no file locks

A holder is gone when its process is gone (on this host: the flock is free, or
its pid does not run) or its beat is older than TRAINLAB_LOST_AFTER_S (default
4 beats, on another host). A lease whose holder is gone is taken over; the
caller is told whom it replaced (`Lease.previous`) and records it.

In a store the record is the lease. Where the store has conditional writes
(S3: If-None-Match / If-Match; `Location.conditional_writes`), taking it is one
compare-and-swap: created only if absent, or replaced only if still at the stale
holder's version, so of two takers exactly one wins however slow either's
request is. Every beat is conditional on the version this holder wrote last: a
beat that finds another holder (the lease was taken over while this holder
could not reach the store) calls `on_lost`. Without conditional writes (the GCS
emulator here), taking it writes this process's record and reads it back after
a pause (TRAINLAB_LOCK_SETTLE_S, default 1 s): of two takers within that pause,
the one whose record is read back wins; a write slower than the pause can still
admit two.

The `.lock` file is never deleted while its folder exists: deleting it would let
a second process lock a new file while the first holds the old one. Its
descriptor is not inherited across exec (Python's default).
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
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainlab.location.errors import Conflict

log = logging.getLogger(__name__)

LOCK = ".lock"
RECORD = ".lock.json"
DEFAULT_BEAT_S = 30.0
MISSED_BEATS = 4
UNKNOWN_HOLDER = "a process that has not said who it is yet"


def beat_s() -> float:
    """How often a holder rewrites its beat (the MLflow heartbeat's setting)."""
    return float(os.environ.get("TRAINLAB_HEARTBEAT_S") or DEFAULT_BEAT_S)


def stale_after_s() -> float:
    """How old a beat from another host is when its holder counts as gone."""
    return float(os.environ.get("TRAINLAB_LOST_AFTER_S") or MISSED_BEATS * beat_s())


@dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a lease."""

    host: str
    pid: int
    since: float  # epoch seconds the lease was taken
    beat: float  # epoch seconds of the holder's newest beat

    @classmethod
    def this_process(cls) -> Holder:
        now = time.time()
        return cls(socket.gethostname(), os.getpid(), now, now)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host} since {when}"

    def on_this_host(self) -> bool:
        return self.host == socket.gethostname()

    def fresh(self, now: float | None = None) -> bool:
        return (now or time.time()) - self.beat <= stale_after_s()

    def record(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    def beaten(self) -> Holder:
        return Holder(self.host, self.pid, self.since, time.time())


def parse_holder(text: str | None) -> Holder | None:
    try:
        d = json.loads(text or "")
        return Holder(str(d["host"]), int(d["pid"]), float(d["since"]), float(d["beat"]))
    except (ValueError, KeyError, TypeError):
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


def alive(holder: Holder) -> bool:
    """A holder known by its record alone is alive: its process runs (on this
    host), or its beat is fresh (on another)."""
    if holder.on_this_host() and not pid_running(holder.pid):
        return False
    return holder.fresh()


def elsewhere_and_fresh(holder: Holder | None) -> bool:
    """A holder on another host that beat recently: alive as far as this host can
    tell, whatever flock says here (a shared filesystem may not carry the lock)."""
    return holder is not None and not holder.on_this_host() and holder.fresh()


class Held(Exception):
    """A live holder has the lease (None: one that has not said who it is yet)."""

    def __init__(self, holder: Holder | None):
        super().__init__(holder.describe() if holder else UNKNOWN_HOLDER)
        self.holder = holder


class Lease:
    """A lease this process holds; `release` (or leaving the `with` block, or the
    process ending) gives it up. `previous`: the gone holder it was taken over
    from, or None."""

    holder: Holder
    previous: Holder | None = None

    def release(self) -> None:  # pragma: no cover - each kind has its own
        raise NotImplementedError

    def abandon(self) -> None:
        """The storage does not answer and this process is ending: send nothing more."""

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


# --------------------------------------------------------------------------- a disk


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def read_record(folder: Path) -> Holder | None:
    """The holder `.lock.json` names in `folder` (a live one, or a dead one that
    never released), or None when there is none or it cannot be read."""
    try:
        return parse_holder((folder / RECORD).read_text())
    except OSError:
        return None


class DiskLease(Lease):
    """The flock of `{folder}/.lock` and the record beside it."""

    def __init__(self, folder: Path, fd: int, holder: Holder):
        self.folder, self.holder = folder, holder
        self._fd: int | None = fd
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_loop, name="trainlab-lease", daemon=True)

    @classmethod
    def take(cls, folder: Path) -> DiskLease:
        """The lease of `folder` (made when missing), or `Held`."""
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _try_flock(fd):
                raise Held(read_record(folder))
            previous = read_record(folder)  # a holder that ended without releasing
            if elsewhere_and_fresh(previous):
                raise Held(previous)
        except BaseException:
            os.close(fd)  # drops the flock with it
            raise
        lease = cls(folder, fd, Holder.this_process())
        lease._write()
        lease.previous = previous
        lease._thread.start()
        return lease

    def release(self) -> None:
        """Stop beating, say nobody holds it, drop the flock. Idempotent."""
        if self._fd is None:
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            (self.folder / RECORD).unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def _write(self) -> None:
        target = self.folder / RECORD
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(self.holder.record())
        tmp.replace(target)

    def _beat_loop(self) -> None:
        while not self._stop.wait(beat_s()):
            self.holder = self.holder.beaten()
            try:
                self._write()
            except OSError as e:  # a vanished folder: its owner's own writes will say so
                log.warning("could not renew the lease record of %s: %s", self.folder, e)


def disk_holder(folder: Path) -> str | None:
    """Who holds `folder`'s lease ("pid N on host H since T") when a live process
    does, else None. Changes nothing: a free flock is taken and dropped at once."""
    holder = read_record(folder)
    try:
        fd = os.open(folder / LOCK, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        fd = None
    if fd is not None:
        try:
            if not _try_flock(fd):
                return holder.describe() if holder else UNKNOWN_HOLDER
        finally:
            os.close(fd)
    return holder.describe() if elsewhere_and_fresh(holder) else None


@contextlib.contextmanager
def disk_kept_still(folder: Path) -> Iterator[str | None]:
    """None while nobody holds `folder`'s lease, its flock held meanwhile (a taker
    in between is refused), without a record or beat; else who holds it."""
    holder = disk_holder(folder)
    try:
        fd = os.open(folder / LOCK, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        yield holder
        return
    try:
        held = _try_flock(fd)
        yield holder if holder is not None else (None if held else UNKNOWN_HOLDER)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- a store


class StoreLease(Lease):
    """The record `{place}/.lock.json` as the lease (see the module's text)."""

    def __init__(self, place: Any, holder: Holder, on_lost: Callable[[str, Holder | None], None]):
        self.place, self.holder, self.on_lost = place, holder, on_lost
        self.version: str | None = None  # what this holder wrote last (conditional)
        self._released = False
        self._abandoned = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_loop, name="trainlab-lease", daemon=True)

    @classmethod
    def take(cls, place: Any, on_lost: Callable[[str, Holder | None], None]) -> StoreLease:
        """The lease of the store location `place`, or `Held`."""
        lease = cls(place, Holder.this_process(), on_lost)
        take = lease._take if place.conditional_writes else lease._take_settled
        lease.previous = take()
        lease._thread.start()
        return lease

    def _take(self) -> Holder | None:
        """The lease by compare-and-swap; the stale holder it replaced, if any."""
        got = self.place.read_versioned(RECORD)
        previous = parse_holder(got[0].decode(errors="replace")) if got else None
        if previous is not None and alive(previous):
            raise Held(previous)
        try:
            self.version = self.place.write_if(RECORD, self._record(), got[1] if got else None)
        except Conflict:
            raise Held(parse_holder(self.place.read_text(RECORD))) from None
        return previous

    def _take_settled(self) -> Holder | None:
        """The lease by write, pause, read back (no conditional writes)."""
        previous = parse_holder(self.place.read_text(RECORD))
        if previous is not None and alive(previous):
            raise Held(previous)
        self._write()
        time.sleep(float(os.environ.get("TRAINLAB_LOCK_SETTLE_S") or 1.0))
        back = parse_holder(self.place.read_text(RECORD))
        if back != self.holder:
            raise Held(back)
        return previous

    def _record(self) -> bytes:
        return self.holder.record().encode()

    def _write(self) -> None:
        self.place.write_text(RECORD, self.holder.record())

    def beat(self) -> bool:
        """Renew the lease now; False (after `on_lost`) when another holder has it."""
        self.holder = self.holder.beaten()
        if self.version is None:
            self._write()
            return True
        try:
            self.version = self.place.write_if(RECORD, self._record(), self.version)
        except Conflict:
            got = self.place.read_versioned(RECORD)
            holder = parse_holder(got[0].decode(errors="replace")) if got else None
            mine = (self.holder.host, self.holder.pid, self.holder.since)
            if got and holder and (holder.host, holder.pid, holder.since) == mine:
                # an earlier beat that landed while its answer was lost (an outage)
                self.version = got[1]
                return True
            self._stop.set()
            self.on_lost(self.place.uri, holder)
            return False
        return True

    def _beat_loop(self) -> None:
        while not self._stop.wait(beat_s()):
            try:
                if not self.beat():
                    return
            except OSError as e:
                log.warning("could not renew the lease record of %s: %s", self.place.uri, e)

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
            if parse_holder(self.place.read_text(RECORD)) == self.holder:
                self.place.delete(RECORD)

    def abandon(self) -> None:
        """The store does not answer and this process is ending: stop beating, and
        let `release` send nothing more (no wait for a beat inside an unanswered
        request, no removal of the record). The lease goes stale; the next taker
        takes it over."""
        self._abandoned = True
        self._stop.set()


@contextlib.contextmanager
def store_kept_still(place: Any) -> Iterator[str | None]:
    """A store has no lock to hold for a moment: its lease is read (the caller
    reads it again right before it deletes anything)."""
    holder = parse_holder(place.read_text(RECORD))
    yield holder.describe() if holder is not None and alive(holder) else None
