"""Checkpoints of a run that lives in object storage (`train.runs_root: s3://...`).

Layout under `{run}/checkpoints/` in the store:

    step-00000020/
      checkpoint.json        the commit marker, written last by rank 0: step, every
                             file with its bytes and sha256, valid, val_loss, ...
      trainer.pt, rng-rank{r}.pt, state/__{r}_0.distcp, state/.metadata
      .done-rank{r}          rank r's part is durable: its files with their sizes
                             and sha256 (removed when the checkpoint is committed)
      .failed-rank{r}        rank r could not upload its part (the save is given up)

Protocol (no shared filesystem, no collectives off the main thread):

1. every rank writes its part into its own staging folder on its node's scratch
   (`{scratch}/runs/.../checkpoints/.tmp-step-N-rank{r}/`: DCP writes each
   rank's `__{r}_0.distcp`, rank 0 also `.metadata` and trainer.pt);
2. every rank uploads its files straight to the store, hashing them on the way,
   then writes `.done-rank{r}` listing them;
3. rank 0 waits for every rank's marker, downloads the parts it lacks into its
   staging folder (checked against the markers' sha256: the store is read back),
   validates the whole checkpoint there as on a local disk, writes
   checkpoint.json (the commit) and applies retention in the store;
   rank 0 keeps its verified copy as this node's cache of the newest checkpoint.

A reader takes only a step folder with checkpoint.json whose files are all
present with their sizes; before loading, each node downloads the checkpoint
into its cache and checks every file's sha256 (`fetch`), so a corrupted part is
never loaded: the next older checkpoint is taken instead.

A store outage (or one rank's upload failing) fails that save only: it is
logged as a warning, never committed, cleaned up at the next start, and the
run goes on (its checkpoint age grows, which the monitor's checkpoint rules
see). A full scratch disk is a storage fault as for a local run.

Every name read from the store (markers, checkpoint.json) is untrusted: it must
be a plain relative name that stays inside the local folder it is written to
(trainlab.nodedisk.resolve_inside), or nothing is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from trainlab.errors import UserError, first_line
from trainlab.location import Absent, Corrupt, StorageError, read_retrying
from trainlab.nodedisk import UnsafePath, resolve_inside
from trainlab.run.checkpoints.info import CheckpointInfo
from trainlab.run.checkpoints.local import retained_steps
from trainlab.run.checkpoints.names import (
    META_FILE,
    PULL_PREFIX,
    STAGING_PREFIX,
    TRASH_PREFIX,
    dir_name,
    parse_step,
)
from trainlab.run.location import RunLocation

# Named as before the catalog moved out of trainlab.train.checkpoint: the same
# logger for log filters and for readers of the logs.
log = logging.getLogger("trainlab.train.checkpoint.store")

DONE = ".done-rank"
FAILED = ".failed-rank"
VERIFIED = ".verified"  # a fetched copy whose files all matched their sha256
PART_TIMEOUT_S = 3600.0


class SaveAbandoned(Exception):
    """A save that will not be committed (a rank's upload failed or timed out)."""


def _sha_and_copy(src: Path, out: Any) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    with open(src, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            out.write(chunk)
            n += len(chunk)
    return n, h.hexdigest()


class CheckpointStore:
    """The checkpoints of one run in object storage."""

    def __init__(self, loc: RunLocation):
        self.loc = loc
        self.fs = loc.home.filesystem
        self.root = loc.key("checkpoints")
        self.local_root = loc.local / "checkpoints"

    def uri(self, step: int | None = None) -> str:
        return self.loc.uri_of("checkpoints" + (f"/{dir_name(step)}" if step is not None else ""))

    def _dir(self, step: int) -> str:
        return f"{self.root}/{dir_name(step)}"

    def _read_json(self, path: str) -> Any:
        """The JSON object at `path`: `Absent` or `Corrupt` when it is not there or
        does not parse; retried while the store is unavailable (`StoreUnavailable`
        when it stays so): a read that did not succeed is never taken for absent."""

        def read() -> Any:
            with self.fs.open_input_stream(path) as f:
                return json.loads(f.read())

        return read_retrying(read, self._uri(path))

    def _write_json(self, path: str, obj: Any) -> None:
        with self.fs.open_output_stream(path) as out:
            out.write(json.dumps(obj, indent=1, sort_keys=True).encode())

    def _names(self, path: str, recursive: bool = False) -> list[Any]:
        """What is under `path` (nothing when it does not exist); an unavailable
        store is retried, never read as an empty listing."""
        from pyarrow import fs

        selector = fs.FileSelector(path, allow_not_found=True, recursive=recursive)
        return read_retrying(lambda: self.fs.get_file_info(selector), f"listing {self._uri(path)}")

    def _uri(self, path: str) -> str:
        """The URI of a store path (for messages)."""
        return self.loc.home.backend.uri(path)

    # ------------------------------------------------------------------ listing

    def step_dirs(self) -> list[int]:
        """Every step folder in the store, committed or not, oldest first."""
        names = read_retrying(
            lambda: self.loc.home.list("checkpoints"), f"listing {self._uri(self.root)}"
        )
        steps = (parse_step(name) for name in names)
        return sorted(s for s in steps if s is not None)

    def commit_state(self, step: int) -> CheckpointInfo | StorageError:
        """The committed checkpoint of `step`, or why there is none: `Absent` (no
        checkpoint.json: never committed, a save that did not finish) or `Corrupt`
        (one that does not parse or names another step). An unavailable store is
        retried and then raises: it says nothing about the checkpoint."""
        where = f"{self.uri(step)}/{META_FILE}"
        try:
            meta = self._read_json(f"{self._dir(step)}/{META_FILE}")
        except (Absent, Corrupt) as err:
            return err
        if not isinstance(meta, dict) or meta.get("step") != step:
            return Corrupt(f"{where}: not the commit of step {step}")
        return CheckpointInfo(self.local_root / dir_name(step), step, meta, uri=self.uri(step))

    def info(self, step: int) -> CheckpointInfo | None:
        """The committed checkpoint of `step` (its checkpoint.json), or None."""
        state = self.commit_state(step)
        return state if isinstance(state, CheckpointInfo) else None

    def committed(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        infos = (self.info(s) for s in self.step_dirs())
        return [i for i in infos if i is not None]

    def missing_or_short(self, info: CheckpointInfo) -> str | None:
        """None when every file checkpoint.json lists is in the store with its size
        (what can be checked without reading them); otherwise what is wrong."""
        from pyarrow import fs

        files = info.meta.get("files")
        if not isinstance(files, dict) or not files:
            return "lists no files"
        for rel in files:  # whoever can write to the store wrote these names
            check_name(rel, f"file name in {info.uri}/{META_FILE}")
        clash = name_clash(list(files))
        if clash:  # a store holds "zz" and "zz/b"; no disk can: corrupt
            return clash
        base = self._dir(info.step)
        found = {
            e.path[len(base) + 1 :]: e.size
            for e in self._names(base, recursive=True)
            if e.type == fs.FileType.File
        }
        for rel, expected in files.items():
            if rel not in found:
                return f"{rel} is missing"
            if found[rel] != expected.get("bytes"):
                return f"{rel} has {found[rel]} bytes, expected {expected.get('bytes')}"
        return None

    def candidates(self, require_valid: bool = True) -> list[CheckpointInfo]:
        """Committed checkpoints a resume may take, newest first (complete in the
        store, and valid when `require_valid`); each one left out is logged."""
        out = []
        for info in reversed(self.committed()):
            if require_valid and not info.valid:
                reason = info.meta.get("error") or "it failed validation"
                log.warning("skipping checkpoint %s: not valid (%s)", info.uri, reason)
                continue
            problem = self.missing_or_short(info)
            if problem:
                log.warning("skipping checkpoint %s: %s", info.uri, problem)
                continue
            out.append(info)
        return out

    def find_resume(self, require_valid: bool = True) -> CheckpointInfo | None:
        """The newest checkpoint a resume would take (files present with their sizes;
        their sha256 is checked when it is fetched)."""
        found = self.candidates(require_valid)
        return found[0] if found else None

    def refusals(self, require_valid: bool = True) -> list[tuple[str, str]]:
        """Each step folder a resume would not take, with why, newest first."""
        out = []
        for step in reversed(self.step_dirs()):
            info = self.commit_state(step)
            if isinstance(info, Absent):
                reason = f"no {META_FILE} (not committed)"
            elif isinstance(info, Corrupt):
                reason = f"{META_FILE} unreadable ({info}): kept as it is"
            elif require_valid and not info.valid:
                reason = f"not valid: {info.meta.get('error') or 'it failed validation'}"
            else:
                reason = self.missing_or_short(info) or ""
            if reason:
                out.append((self.uri(step), reason))
        return out

    # ------------------------------------------------------------------ writing

    def staging_dir(self, step: int, rank: int) -> Path:
        """Rank `rank`'s local staging folder for its part of `step`."""
        return self.local_root / f"{STAGING_PREFIX}{dir_name(step)}-rank{rank}"

    def upload_part(self, staging: Path, step: int, rank: int) -> dict[str, dict[str, Any]]:
        """Upload every file of `staging` under the step's folder, then the rank's
        done marker listing them (bytes, sha256); returns that list."""
        base = self._dir(step)
        files: dict[str, dict[str, Any]] = {}
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            rel = path.relative_to(staging).as_posix()
            with self.fs.open_output_stream(f"{base}/{rel}") as out:
                size, sha = _sha_and_copy(path, out)
            files[rel] = {"bytes": size, "sha256": sha}
        self._write_json(f"{base}/{DONE}{rank}", files)
        return files

    def mark_part_failed(self, step: int, rank: int, error: str) -> None:
        """Tell rank 0 that this rank's part of `step` will not come (best effort:
        the store may be what failed)."""
        with contextlib.suppress(Exception):  # rank 0 times out instead
            self._write_json(f"{self._dir(step)}/{FAILED}{rank}", {"error": error})

    def wait_parts(
        self, step: int, world_size: int, timeout_s: float = PART_TIMEOUT_S
    ) -> dict[str, dict[str, Any]]:
        """Every rank's file list once all done markers are in the store (merged);
        `SaveAbandoned` when a rank reported a failed upload or the time is up."""
        base, deadline, delay = self._dir(step), time.monotonic() + timeout_s, 0.05
        while True:
            names = {e.base_name for e in self._names(base)}  # files: listed on every store
            failed = sorted(n for n in names if n.startswith(FAILED))
            if failed:
                why = self._read_json(f"{base}/{failed[0]}").get("error", "?")
                raise SaveAbandoned(f"{failed[0][1:]}: {why}")
            if all(f"{DONE}{r}" in names for r in range(world_size)):
                break
            if time.monotonic() > deadline:
                done = sum(f"{DONE}{r}" in names for r in range(world_size))
                raise SaveAbandoned(
                    f"only {done}/{world_size} ranks uploaded their part in {timeout_s:.0f} s"
                )
            time.sleep(delay)
            delay = min(1.0, delay * 1.5)
        files: dict[str, dict[str, Any]] = {}
        for r in range(world_size):
            part = self._read_json(f"{base}/{DONE}{r}")
            if not isinstance(part, dict):
                raise SaveAbandoned(f"rank {r}'s done marker is not a JSON object")
            files.update(part)
        return files

    def download(
        self, step: int, files: dict[str, Any], target: Path, skip: set[str] = frozenset()
    ) -> None:
        """Download the listed files of `step` (but `skip`) into `target`, each
        checked against its bytes and sha256 (`ValueError` on a mismatch); names
        are checked to stay inside `target` before anything is written."""
        what = f"file name listed for {self.uri(step)}"
        todo = []
        for rel in sorted(files, key=str):
            if rel == META_FILE or str(rel).startswith((DONE, FAILED)):
                raise UnsafePath(f"{what} {rel!r} is a marker, not a part")
            todo.append((rel, resolve_inside(target, rel, what)))
        base = self._dir(step)
        for rel, dest in todo:
            if rel in skip:
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            h, n = hashlib.sha256(), 0
            with self.fs.open_input_stream(f"{base}/{rel}") as inp, open(dest, "wb") as out:
                while chunk := inp.read(8 << 20):
                    h.update(chunk)
                    out.write(chunk)
                    n += len(chunk)
            expected = files[rel]
            if n != expected.get("bytes") or h.hexdigest() != expected.get("sha256"):
                raise ValueError(f"{rel} does not match its sha256 (corrupted in the store)")

    def commit(self, step: int, meta: dict[str, Any]) -> None:
        """Write checkpoint.json (the commit), then remove the done markers."""
        base = self._dir(step)
        self._write_json(f"{base}/{META_FILE}", meta)
        for r in range(int(meta.get("world_size") or 0) or 1):
            with contextlib.suppress(OSError):
                self.fs.delete_file(f"{base}/{DONE}{r}")

    def delete(self, step: int) -> None:
        """Remove a step folder: checkpoint.json first, so a half-deleted one is
        never taken for a checkpoint."""
        base = self._dir(step)
        with contextlib.suppress(OSError):
            self.fs.delete_file(f"{base}/{META_FILE}")
        with contextlib.suppress(OSError):
            self.fs.delete_dir(base)

    def prune(self, keep_last: int, keep_best: int) -> list[int]:
        """Delete committed checkpoints retention does not keep; return their steps."""
        infos = self.committed()
        keep = retained_steps(infos, keep_last, keep_best)
        gone = [i.step for i in infos if i.step not in keep]
        for step in gone:
            self.delete(step)
        return gone

    def clean_uncommitted(self) -> list[int]:
        """Remove the step folders whose checkpoint.json the store says is not there
        (saves a crashed or failed attempt left; called once at the start of an
        attempt, under the run lock). A checkpoint.json that could not be read
        (store unavailable: `StoreUnavailable` after retries) or does not parse
        (corrupt) keeps its folder: nothing is deleted on a read that did not
        succeed."""
        gone = []
        for step in self.step_dirs():
            state = self.commit_state(step)
            if isinstance(state, Absent):
                gone.append(step)
            elif isinstance(state, Corrupt):
                log.warning("keeping %s: %s", self.uri(step), state)
        for step in gone:
            self.delete(step)
        return gone

    # ------------------------------------------------------------------ reading

    def fetch(self, info: CheckpointInfo) -> CheckpointInfo:
        """This node's verified copy of checkpoint `info` (downloaded into the
        scratch cache unless a verified copy of the same commit is there; ranks of
        one node share it, under a file lock). `ValueError` when a file does not
        match its sha256."""
        from filelock import FileLock

        final = self.local_root / dir_name(info.step)
        self.local_root.mkdir(parents=True, exist_ok=True)
        marker = json.dumps(info.meta, sort_keys=True)
        with FileLock(str(final) + ".lock"):
            try:
                if (final / VERIFIED).read_text() == marker:
                    return CheckpointInfo(final, info.step, info.meta, uri=info.uri)
            except OSError:
                pass
            part = self.local_root / f"{PULL_PREFIX}{dir_name(info.step)}"
            shutil.rmtree(part, ignore_errors=True)
            part.mkdir(parents=True)
            try:
                self.download(info.step, info.meta.get("files") or {}, part)
            except BaseException:
                shutil.rmtree(part, ignore_errors=True)
                raise
            (part / META_FILE).write_text(json.dumps(info.meta, indent=1, sort_keys=True))
            (part / VERIFIED).write_text(marker)
            shutil.rmtree(final, ignore_errors=True)
            part.rename(final)
        return CheckpointInfo(final, info.step, info.meta, uri=info.uri)

    def fetch_newest(self, require_valid: bool = True) -> CheckpointInfo | None:
        """The newest checkpoint whose every file arrives intact, fetched (older ones
        are tried after a corrupted one, with a warning); None when there is none."""
        try:
            candidates = self.candidates(require_valid)
        except UnsafePath as e:
            raise UserError(f"refusing a checkpoint of {self.loc.uri}: {e}; nothing was "
                            "restored. Whoever can write to the store wrote it: check who "
                            "can, and delete that checkpoint.json") from None  # fmt: skip
        for info in candidates:
            try:
                return self.fetch(info)
            except UnsafePath as e:
                raise refused(info, e) from None
            except ValueError as e:
                log.warning("skipping checkpoint %s: %s", info.uri, e)
        return None

    def keep_cache(self, newest_step: int) -> None:
        """Drop this node's cached copies other than `newest_step`'s."""
        if not self.local_root.is_dir():
            return
        for child in self.local_root.iterdir():
            step = parse_step(child.name)
            stale = step is not None and step != newest_step
            if child.is_dir() and (stale or child.name.startswith(TRASH_PREFIX)):
                shutil.rmtree(child, ignore_errors=True)


def check_name(name: object, what: str) -> None:
    """A name listed in the store must be a plain relative POSIX name without `..`
    (it becomes a path on a node); `UnsafePath` otherwise."""
    from pathlib import PurePosixPath

    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise UnsafePath(f"{what} {name!r} is not a plain relative file name")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts or name.startswith("~"):
        raise UnsafePath(f"{what} {name!r} leads outside the checkpoint")


def name_clash(names: list[str]) -> str | None:
    """Why the file names a checkpoint lists cannot all be files of one folder (one
    names the same file as another, or a folder holding another), or None."""
    from pathlib import PurePosixPath

    seen: dict[str, str] = {}
    for name in names:
        key = PurePosixPath(name).as_posix()
        if key in seen:
            return f"its file names {seen[key]!r} and {name!r} are the same file"
        seen[key] = name
    for key, name in seen.items():
        for parent in PurePosixPath(key).parents:
            if str(parent) in seen:
                return (
                    f"its file names {seen[str(parent)]!r} and {name!r} nest (a file and a folder)"
                )
    return None


def refused(info: CheckpointInfo, error: UnsafePath) -> UserError:
    """The error of a checkpoint whose listing names files outside it."""
    return UserError(
        f"refusing the checkpoint {info.uri}: {error}; nothing was restored. Whoever can "
        "write to the store wrote this checkpoint.json: check who can, and delete it"
    )


def abandoned_text(step: int, store: CheckpointStore, error: BaseException) -> str:
    return (
        f"checkpoint step {step} was not saved to {store.uri()} ({first_line(error)}); "
        "training goes on, the next save tries again"
    )
