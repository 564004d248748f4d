"""Where a run lives: a directory (local or shared) or a prefix in object storage.

A run's home is `{runs_root}/{date}/{name}`. With a local or shared runs root
it is a directory, as it always was. With `train.runs_root: s3://bucket/prefix`
it is a prefix in the store, and every node keeps a *working copy* of it under
its scratch area (`resource.scratch_dir`, trainlab.storage.scratch_root):

    {scratch}/runs/{bucket}/{prefix}/{date}/{name}/
        logs/          this node's own log files (rank{r}.log, driver.log, the
                       MLflow journal), uploaded to the store by their writer
                       (`ship_logs`) while the run goes and when it ends
        checkpoints/   parts staged before upload, checkpoints downloaded to resume

Nothing in the working copy is the only copy of anything that matters: the
records (`trainlab.train.records`), config.yaml, plan.json and checkpoints are
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
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainlab.fileutil import write_text_atomic
from trainlab.storage import Storage, is_uri, resolve_storage, scratch_root

APPENDS_SUFFIX = ".d"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunLocation:
    """A run's home. `uri`: the absolute path or the store URI (what records and
    messages name); `local`: this node's directory for it (the run directory
    itself when local, the working copy when in a store)."""

    uri: str
    local: Path
    storage: Storage | None = None  # set when the run lives in object storage

    @classmethod
    def of(cls, where: str | os.PathLike[str], scratch_dir: str | None = None) -> RunLocation:
        """The location of the run at `where` (a path, or a store URI)."""
        return _location(os.fspath(where), scratch_dir)

    @classmethod
    def _make(cls, text: str, scratch_dir: str | None) -> RunLocation:
        if not is_uri(text) or text.startswith("file://"):
            path = Path(text.removeprefix("file://")).expanduser().absolute()
            return cls(uri=str(path), local=path)
        storage = resolve_storage(text)
        if storage.kind == "local":
            return cls(uri=storage.uri, local=Path(storage.path))
        return cls(uri=storage.uri, local=working_copy(storage, scratch_dir), storage=storage)

    @property
    def remote(self) -> bool:
        return self.storage is not None

    @property
    def name(self) -> str:
        return self.uri.rstrip("/").rsplit("/", 1)[-1]

    def key(self, rel: str) -> str:
        """The store path of `rel` (remote runs)."""
        assert self.storage is not None
        return self.storage.join(rel)

    def uri_of(self, rel: str) -> str:
        return f"{self.uri.rstrip('/')}/{rel.strip('/')}"

    # ------------------------------------------------------------------ files

    def read_bytes(self, rel: str) -> bytes | None:
        """The file's content, or None when it does not exist."""
        if self.storage is None:
            try:
                return (self.local / rel).read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                return None
        fs = self.storage.filesystem
        try:
            with fs.open_input_stream(self.key(rel)) as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:  # pyarrow: "Path does not exist" is an OSError on S3
            if "does not exist" in str(e) or "NoSuchKey" in str(e):
                return None
            raise

    def read_text(self, rel: str) -> str | None:
        data = self.read_bytes(rel)
        return None if data is None else data.decode()

    def write_text(self, rel: str, text: str) -> None:
        """Write the whole file at once: a reader sees the old or the new content."""
        if self.storage is None:
            path = self.local / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, text)
            return
        with self.storage.filesystem.open_output_stream(self.key(rel)) as out:
            out.write(text.encode())

    def upload(self, src: Path, rel: str) -> None:
        """Copy a local file to `rel` (remote runs; a local run's files are in place)."""
        import shutil

        assert self.storage is not None
        with open(src, "rb") as f, self.storage.filesystem.open_output_stream(self.key(rel)) as out:
            shutil.copyfileobj(f, out, 8 << 20)

    def exists(self, rel: str) -> bool:
        if self.storage is None:
            return (self.local / rel).exists()
        from pyarrow import fs

        info = self.storage.filesystem.get_file_info(self.key(rel))
        if info.type != fs.FileType.NotFound:
            return True
        return bool(self.list(rel))  # S3 has no empty folders: one with objects exists

    def delete(self, rel: str) -> None:
        """Delete a file (no error when it is not there)."""
        if self.storage is None:
            with contextlib.suppress(FileNotFoundError):
                (self.local / rel).unlink()
            return
        with contextlib.suppress(FileNotFoundError):
            self.storage.filesystem.delete_file(self.key(rel))

    def list(self, rel: str) -> list[str]:
        """Names directly inside folder `rel` (sorted; [] when there is none)."""
        if self.storage is None:
            d = self.local / rel
            return sorted(p.name for p in d.iterdir()) if d.is_dir() else []
        from pyarrow import fs

        try:
            entries = self.storage.filesystem.get_file_info(
                fs.FileSelector(self.key(rel), allow_not_found=True)
            )
        except FileNotFoundError:
            return []
        return sorted(e.base_name for e in entries)

    def is_empty(self) -> bool:
        return not self.list("")

    # ------------------------------------------------------------------ appends

    def append_jsonl(self, rel: str, records: list[dict[str, Any]]) -> None:
        """Append records to a JSON-lines file. Local: O_APPEND writes of whole lines
        (several processes may append; lines never interleave). Store: one object
        per call under `{rel}.d/`."""
        text = "".join(json.dumps(r) + "\n" for r in records)
        if self.storage is None:
            path = self.local / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(text)
            return
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.jsonl"
        self.write_text(f"{rel}{APPENDS_SUFFIX}/{name}", text)

    def read_jsonl(self, rel: str) -> list[dict[str, Any]]:
        """The records of a JSON-lines file, oldest first; torn or foreign lines
        are skipped."""
        if self.storage is None:
            text = self.read_text(rel) or ""
        else:
            folder = f"{rel}{APPENDS_SUFFIX}"
            parts = [self.read_text(f"{folder}/{n}") for n in self.list(folder)]
            text = "".join(p for p in parts if p)
        out = []
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    out.append(rec)
        return out


@functools.lru_cache(maxsize=64)
def _location(text: str, scratch_dir: str | None) -> RunLocation:
    return RunLocation._make(text, scratch_dir)


def working_copy(storage: Storage, scratch_dir: str | None = None) -> Path:
    """This node's working copy of the store location `storage` (under scratch)."""
    return scratch_root(scratch_dir) / "runs" / storage.path.strip("/")


def local_runs_root(runs_root: str, scratch_dir: str | None = None) -> Path:
    """This node's directory for the runs root `runs_root` (absolute, as the config
    layer leaves it): the root itself, or for a root in object storage its working
    copy on this node's scratch (where the embedded MLflow store of runs in the
    store lives: SQLite cannot live in object storage; docs/storage.md)."""
    if is_uri(runs_root) and not runs_root.startswith("file://"):
        storage = resolve_storage(runs_root)
        if storage.kind != "local":
            return working_copy(storage, scratch_dir)
    return Path(runs_root.removeprefix("file://")).expanduser().absolute()


def ship_logs(loc: RunLocation, names: list[str] | None = None) -> list[str]:
    """Upload this node's log files of a remote run (all of logs/, or `names` in
    it) that changed since they were last shipped; returns the names uploaded.
    Each log file has one writer (rank{r}.log, driver.log, ...), so copies from
    different nodes never collide. A local run's logs are already in place."""
    if loc.storage is None:
        return []
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
    `interval_s` and when it ends (trainlab.runloc.ship_logs); a context manager."""

    def __init__(self, loc: RunLocation, names: list[str] | None = None, interval_s: float = 30.0):
        self.loc, self.names, self.interval_s = loc, names, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trainlab-logs", daemon=True)

    def __enter__(self) -> LogShipper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.ship()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.ship()

    def ship(self) -> None:
        try:
            ship_logs(self.loc, self.names)
        except Exception as e:  # noqa: BLE001 - an outage must not stop the run
            log.warning("could not upload the logs to %s: %s", self.loc.uri_of("logs"), e)
