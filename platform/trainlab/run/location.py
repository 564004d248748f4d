"""Where a run lives: a directory (local or shared) or a prefix in object storage.

A run's home is `{runs_root}/{date}/{name}`. With a local or shared runs root
it is a directory, as it always was. With `train.runs_root: s3://bucket/prefix`
it is a prefix in the store, and every node keeps a *working copy* of it under
its scratch area (`resource.scratch_dir`, trainlab.nodedisk.scratch_root):

    {scratch}/runs/{bucket}/{prefix}/{date}/{name}/
        logs/          this node's own log files (rank{r}.log, driver.log, the
                       MLflow journal), uploaded to the store by their writer
                       (`ship_logs`) while the run goes and when it ends
        checkpoints/   parts staged before upload, checkpoints downloaded to resume

Nothing in the working copy is the only copy of anything that matters: the
records (`trainlab.run.records`), config.yaml, plan.json and checkpoints are
written to the store directly, and a working copy can be deleted at any time
between runs (a fresh node starts from none).

`RunLocation` gives the few file operations the records need on either kind:
read, atomic write, delete, existence, and JSON-lines appends. A store has no
append, so an appended "file" there is a folder of one object per append
(`logs/attempts.jsonl.d/{time_ns}-{random}.json`), read back in name order:
appends from processes on different nodes never overwrite each other.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainlab.location import APPENDS_SUFFIX, Location, locate
from trainlab.nodedisk import scratch_root

__all__ = ["APPENDS_SUFFIX", "LogShipper", "RunLocation", "local_runs_root", "ship_logs"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunLocation:
    """A run's home. `home`: where its files are (trainlab.location; `uri` names it
    in records and messages); `local`: this node's directory for it (the run
    directory itself when on this machine's disk, the working copy when in a
    store). Every file operation goes through `home`, whatever it is."""

    home: Location
    local: Path

    @classmethod
    def of(
        cls,
        where: str | os.PathLike[str] | Location,
        scratch_dir: str | None = None,
        what: str = "run directory",
    ) -> RunLocation:
        """The location of the run at `where` (a path, a store URI, a Location); a
        bad value is a one-line UserError naming `what`."""
        return _location(locate(where, what=what), scratch_dir)


    @property
    def uri(self) -> str:
        return self.home.uri

    @property
    def remote(self) -> bool:
        """True when the run is not on this machine's disk (an object store): its
        logs are shipped and its checkpoints staged through `local`."""
        return not self.home.is_local

    @property
    def name(self) -> str:
        return self.home.name

    def key(self, rel: str) -> str:
        """The path inside the storage's filesystem of `rel`."""
        return self.home.fs_path(rel)

    def uri_of(self, rel: str) -> str:
        return self.home.uri_of(rel)

    # ------------------------------------------------------------------ files

    def read_bytes(self, rel: str) -> bytes | None:
        """The file's content, or None when it does not exist (a failed read of
        another kind raises, trainlab.location.errors)."""
        return self.home.read_or_none(rel)

    def read_text(self, rel: str) -> str | None:
        return self.home.read_text(rel)

    def write_text(self, rel: str, text: str) -> None:
        """Write the whole file at once: a reader sees the old or the new content."""
        self.home.write_text(rel, text)

    def upload(self, src: Path, rel: str) -> None:
        """Copy a local file to `rel`."""
        self.home.upload(src, rel)

    def fetch(self, rel: str) -> bool:
        """Bring `rel` from the run's home into this node's folder of it (`local`;
        on a disk it is there already); False when the run has no such file."""
        return self.home.copy_to(rel, self.local / rel)

    def ship(self, rel: str) -> None:
        """Put this node's `rel` (in `local`) back into the run's home (on a disk it
        is there already)."""
        self.home.copy_from(self.local / rel, rel)

    def exists(self, rel: str) -> bool:
        return self.home.exists(rel)

    def delete(self, rel: str) -> None:
        """Delete a file (no error when it is not there)."""
        self.home.delete(rel)

    def list(self, rel: str) -> list[str]:
        """Names directly inside folder `rel` (sorted; [] when there is none)."""
        return self.home.list(rel)

    def is_empty(self) -> bool:
        return self.home.is_empty()

    # ------------------------------------------------------------------ appends

    def append_jsonl(self, rel: str, records: list[dict[str, Any]]) -> None:
        """Append records to a JSON-lines file (several processes, several nodes)."""
        self.home.append_jsonl(rel, records)

    def read_jsonl(self, rel: str) -> list[dict[str, Any]]:
        """The records of a JSON-lines file, oldest first; torn lines are skipped."""
        return self.home.read_jsonl(rel)


@functools.lru_cache(maxsize=64)
def _location(home: Location, scratch_dir: str | None) -> RunLocation:
    """The run at `home`; a run in a store has its working copy on this node's
    scratch (trainlab.nodedisk), under runs/."""
    return RunLocation(home=home, local=home.folder_here(scratch_root(scratch_dir) / "runs"))


def local_runs_root(runs_root: str, scratch_dir: str | None = None) -> Path:
    """This node's directory for the runs root `runs_root` (absolute, as the config
    layer leaves it): the root itself, or for a root in object storage its working
    copy on this node's scratch (where the embedded MLflow store of runs in the
    store lives: SQLite cannot live in object storage; docs/storage.md)."""
    return _location(locate(runs_root, what="train.runs_root"), scratch_dir).local


def ship_logs(loc: RunLocation, names: list[str] | None = None) -> list[str]:
    """Upload this node's log files of a run in a store (all of logs/, or `names`
    in it) from its working copy, those changed since they were last shipped;
    returns the names uploaded. Each log file has one writer (rank{r}.log,
    driver.log, ...), so copies from different nodes never collide. Only
    `LogShipper` calls it, and only for a run in a store: a run's logs on a disk
    are in place."""
    logs = loc.local / "logs"
    if not logs.is_dir():
        return []
    shipped = []
    for path in sorted(logs.iterdir()):
        if (
            not path.is_file()
            or path.name.startswith(".")
            or path.suffix == ".lock"  # a lock is of this node only
            or (names and path.name not in names)
        ):
            continue
        stamp = logs / f".shipped-{path.name}"
        st = path.stat()
        sig = f"{st.st_size}:{st.st_mtime_ns}"
        with contextlib.suppress(OSError):
            if stamp.read_text() == sig:
                continue
        loc.upload(path, f"logs/{path.name}")
        stamp.write_text(sig)
        shipped.append(path.name)
    return shipped


class LogShipper:
    """Uploads this process's log files of a run in object storage every
    `interval_s` and when it ends (trainlab.run.location.ship_logs); a context
    manager. For a run on a disk it does nothing: the logs are already in place."""

    def __init__(self, loc: RunLocation, names: list[str] | None = None, interval_s: float = 30.0):
        self.loc, self.names, self.interval_s = loc, names, interval_s
        self._abandoned = self._shipping = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trainlab-logs", daemon=True)

    def __enter__(self) -> LogShipper:
        self._shipping = self.loc.remote
        if self._shipping:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._abandoned or not self._shipping:
            return
        self._thread.join(timeout=5)
        self.ship()

    def abandon(self) -> None:
        """The store does not answer and this process is ending: ship nothing more
        (the logs stay on this node's working copy)."""
        self._abandoned = True
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.ship()

    def ship(self) -> None:
        try:
            ship_logs(self.loc, self.names)
        except Exception as e:  # noqa: BLE001 - an outage must not stop the run
            log.warning("could not upload the logs to %s: %s", self.loc.uri_of("logs"), e)
