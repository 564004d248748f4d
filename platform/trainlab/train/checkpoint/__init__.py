"""Checkpoints on disk: atomic commits, validation, retention, resume selection.

Layout under `{run_dir}/checkpoints/`:

    step-00000020/              a committed checkpoint (the rename is the commit)
      checkpoint.json           written last: step, files + sha256, valid, val_loss, ...
      trainer.pt                step, data position, config hash, dataset fingerprint
      rng-rank0.pt ...          RNG of Python, NumPy, torch (CUDA) of every rank
      state/                    torch.distributed.checkpoint (DCP) shards, every layout
    .tmp-step-00000040/         being written; never read, removed on the next start
                                (and at once when its write fails: `StorageFault`)

Protocol, with no collectives off the main thread: every rank writes its files
into the staging directory and then a `.done-rank{r}` marker; rank 0 waits for
all markers, hashes the files, loads the model into a fresh CPU model and runs
one forward on a fixed batch (`validate`), writes checkpoint.json, renames the
directory into place and prunes old checkpoints (keep_last newest valid + the
keep_best valid ones of lowest val_loss). With `async_save` the writing runs in
a background thread while training continues.

Why not Ray Train's own checkpoint registry (`ray.train.report(checkpoint=)`):
its run snapshot refuses to restore once a checkpoint it recorded is deleted by
our retention, and `get_checkpoint()` returns the newest reported checkpoint
whether or not it loads. Resume here picks the newest checkpoint that is marked
valid AND whose files still match their checksums, warning about each one skipped.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainlab.fileutil import sha256_file

META_FILE = "checkpoint.json"
FORMAT_VERSION = 1
PREFIX = "step-"
STAGING_PREFIX = ".tmp-"
PULL_PREFIX = ".pull-"  # a checkpoint being fetched from object storage (checkpoint.store)
TRASH_PREFIX = ".trash-"  # a checkpoint retention is deleting (`remove_checkpoint`)
DONE_PREFIX = ".done-rank"

log = logging.getLogger(__name__)


def dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    if not name.startswith(PREFIX):
        return None
    digits = name[len(PREFIX) :]
    return int(digits) if digits.isdigit() else None


# --------------------------------------------------------------------------- faults

# How a fault of the run's storage is named in records (the OS's text otherwise).
FAULT_TEXT = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EIO: "I/O error",
    errno.EROFS: "read-only file system",
}


class Orphaned(RuntimeError):
    """This worker group's driver is gone (killed) or another driver holds the run
    now: the group must not commit anything more (trainlab.train.driver.runlock
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


# --------------------------------------------------------------------------- files


def save_file(obj: Any, path: Path) -> None:
    """torch.save and fsync, so a committed checkpoint survives a power cut."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def load_file(path: Path) -> Any:
    """Only tensors and plain containers: never unpickles arbitrary objects."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _payload_files(directory: Path) -> list[Path]:
    """Every file of a checkpoint except its metadata and markers, sorted."""
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file()
        and p.name != META_FILE
        # the ranks' done markers and a metadata file being written are not payload;
        # DCP's own `.metadata` is (the index of every rank's shards)
        and not p.name.startswith(DONE_PREFIX)
        and not p.name.endswith(".tmp")
    )


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path  # on this node (for a run in object storage: its cached copy)
    step: int
    meta: dict[str, Any]
    uri: str | None = None  # where it lives, for a run in object storage

    @property
    def where(self) -> str:
        """Its location for people and records: the store URI, else the path."""
        return self.uri or str(self.path)

    @property
    def valid(self) -> bool:
        return self.meta.get("valid") is True

    @property
    def val_loss(self) -> float | None:
        v = self.meta.get("val_loss")
        return float(v) if v is not None else None


def read_info(path: Path) -> CheckpointInfo | None:
    """The checkpoint at `path`, or None when it has no readable metadata."""
    step = parse_step(path.name)
    return None if step is None else read_info_at(path, step)


def read_info_at(path: Path, step: int) -> CheckpointInfo | None:
    """The checkpoint of `step` in directory `path` (any name), or None when its
    metadata is missing, unreadable or of another step."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("step") != step:
        return None
    return CheckpointInfo(path, step, meta)


def committed(root: Path) -> list[CheckpointInfo]:
    """Committed checkpoints under `root`, oldest first; a directory with a
    missing or broken checkpoint.json is reported and left out."""
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        if not child.is_dir() or parse_step(child.name) is None:
            continue
        info = read_info(child)
        if info is None:
            log.warning("checkpoint %s has no readable %s; ignoring it", child, META_FILE)
            continue
        out.append(info)
    return sorted(out, key=lambda i: i.step)


def verify(info: CheckpointInfo) -> str | None:
    """None when every file listed in checkpoint.json exists with its size and
    sha256; otherwise what is wrong."""
    files = info.meta.get("files")
    if not isinstance(files, dict) or not files:
        return "lists no files"
    for rel, expected in files.items():
        path = info.path / rel
        try:
            size = path.stat().st_size
        except OSError:
            return f"{rel} is missing"
        if size != expected.get("bytes"):
            return f"{rel} has {size} bytes, expected {expected.get('bytes')}"
        if sha256_file(path) != expected.get("sha256"):
            return f"{rel} does not match its sha256 (corrupted)"
    return None


def find_resume(root: Path, require_valid: bool = True) -> CheckpointInfo | None:
    """The newest checkpoint to resume from: marked valid (when `require_valid`)
    and intact on disk. Newer ones that fail are skipped with a warning."""
    for info in reversed(committed(root)):
        if require_valid and not info.valid:
            reason = info.meta.get("error") or "it failed validation"
            log.warning("skipping checkpoint %s: not valid (%s)", info.path, reason)
            continue
        problem = verify(info)
        if problem:
            log.warning("skipping checkpoint %s: %s", info.path, problem)
            continue
        return info
    return None


def refusals(root: Path, require_valid: bool = True) -> list[tuple[Path, str]]:
    """Each checkpoint directory under `root` that `find_resume` would not take, with
    why, newest first (what a resume that finds none has to say)."""
    if not root.is_dir():
        return []
    out = []
    dirs = [c for c in root.iterdir() if c.is_dir() and parse_step(c.name) is not None]
    for child in sorted(dirs, key=lambda c: parse_step(c.name) or 0, reverse=True):
        info = read_info(child)
        if info is None:
            reason = f"no readable {META_FILE}"
        elif require_valid and not info.valid:
            reason = f"not valid: {info.meta.get('error') or 'it failed validation'}"
        else:
            reason = verify(info) or ""
        if reason:
            out.append((child, reason))
    return out


# The one format trainlab writes and reads: torch.distributed.checkpoint under
# state/ (trainlab.train.loop.checkpointer).
FORMAT = "dcp"


def foreign_config(info: CheckpointInfo, config_hash: str) -> str | None:
    """What makes checkpoint `info` not this experiment's, or None. (Whether its
    dataset may differ is the data stream's rule: trainlab.data.check_resume.)"""
    fmt = info.meta.get("format")
    if fmt != FORMAT:
        return (
            f"{info.path}: checkpoint format {fmt!r}, which this trainlab does not read "
            f"(it writes and reads {FORMAT!r}: torch.distributed.checkpoint); start a new run"
        )
    theirs = info.meta.get("config_hash")
    if theirs != config_hash:
        return (
            f"{info.path}: trained with config hash {theirs}, this config is {config_hash}; "
            "start a new run instead of resuming"
        )
    return None


def data_state(info: CheckpointInfo) -> dict[str, Any]:
    """The data position recorded in a checkpoint's metadata, in the form the data
    stream checks on resume (trainlab.data.check_resume)."""
    return {"step": info.step, "fingerprint": info.meta.get("dataset_fingerprint")}


def best(infos: list[CheckpointInfo]) -> CheckpointInfo | None:
    """The valid checkpoint with the lowest val_loss (newest on ties)."""
    scored = [i for i in infos if i.valid and i.val_loss is not None]
    return min(scored, key=lambda i: (i.val_loss, -i.step)) if scored else None


# --------------------------------------------------------------------------- retention


def retained_steps(infos: list[CheckpointInfo], keep_last: int, keep_best: int) -> set[int]:
    """Steps to keep: the keep_last newest valid checkpoints, the keep_best valid ones
    of lowest val_loss, and anything newer than the newest valid one (a run never
    deletes what it could still need to diagnose a failed validation)."""
    valid = [i for i in infos if i.valid]
    keep = {i.step for i in valid[-keep_last:]} if keep_last else set()
    scored = sorted(
        (i for i in valid if i.val_loss is not None), key=lambda i: (i.val_loss, -i.step)
    )
    keep |= {i.step for i in scored[:keep_best]}
    newest_valid = valid[-1].step if valid else -1
    keep |= {i.step for i in infos if i.step > newest_valid}
    return keep


def prune(root: Path, keep_last: int, keep_best: int) -> list[Path]:
    """Delete committed checkpoints that retention does not keep; return them."""
    infos = committed(root)
    keep = retained_steps(infos, keep_last, keep_best)
    removed = []
    for info in infos:
        if info.step not in keep:
            remove_checkpoint(info.path)
            removed.append(info.path)
    return removed


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder so that a kill midway leaves no step folder behind:
    renamed out of the step names first (atomic), then removed; a leftover is
    removed at the next start (`clean_staging`). Deleted in place, a kill could
    leave `step-N/` without its checkpoint.json (seen in CI: an attempt killed while
    the background writer pruned), which nothing would ever remove."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        path.rename(trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def clean_staging(root: Path) -> None:
    """Remove half-written checkpoints, and half-deleted ones, left by a crashed
    attempt (rank 0, at start, before any rank writes)."""
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith((STAGING_PREFIX, PULL_PREFIX, TRASH_PREFIX)):
                shutil.rmtree(child, ignore_errors=True)


# --------------------------------------------------------------------------- writing


@dataclass
class Validation:
    ok: bool
    loss: float | None = None
    error: str | None = None


Validator = Callable[[Path], Validation]


def commit(
    staging: Path, final: Path, meta: dict[str, Any], validator: Validator | None
) -> CheckpointInfo:
    """Hash, validate, write checkpoint.json, rename into place (rank 0)."""
    files = {
        str(p.relative_to(staging)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in _payload_files(staging)
    }
    meta = committed_meta(staging, meta, files, validator)
    tmp_meta = staging / (META_FILE + ".tmp")
    tmp_meta.write_text(json.dumps(meta, indent=1, sort_keys=True))
    with open(tmp_meta, "rb+") as f:
        os.fsync(f.fileno())
    tmp_meta.rename(staging / META_FILE)
    for marker in staging.glob(DONE_PREFIX + "*"):
        marker.unlink()
    if final.exists():  # an earlier attempt's checkpoint of this step, skipped on resume
        remove_checkpoint(final)
    staging.rename(final)
    _fsync_dir(final.parent)
    return CheckpointInfo(final, meta["step"], meta)


def committed_meta(
    staging: Path,
    meta: dict[str, Any],
    files: dict[str, dict[str, Any]],
    validator: Validator | None,
) -> dict[str, Any]:
    """checkpoint.json of a checkpoint whose complete files are in `staging`:
    `meta` with the files' list and the outcome of `validator` run on it."""
    result = Validation(ok=True)
    if validator is not None:
        try:
            result = validator(staging)
        except Exception as e:  # noqa: BLE001 - any failure to load means "not valid"
            result = Validation(ok=False, error=f"{type(e).__name__}: {e}")
    meta = {
        **meta,
        "format_version": FORMAT_VERSION,
        "files": files,
        "validated": validator is not None,
        "valid": result.ok,
        "validation_loss": result.loss,
        "error": result.error,
        "committed_at": time.time(),
    }
    if "val_loss" not in meta:  # a writer that names no held-out loss: validation's
        meta["val_loss"] = result.loss
    return meta


def first_line_of(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def write_done_marker(staging: Path, rank: int) -> None:
    (staging / f"{DONE_PREFIX}{rank}").touch()


def wait_for_ranks(staging: Path, world_size: int, timeout_s: float = 3600.0) -> None:
    """Filesystem barrier: every rank has written its part of the checkpoint."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = sum(1 for r in range(world_size) if (staging / f"{DONE_PREFIX}{r}").exists())
        if done == world_size:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"checkpoint {staging}: only {done}/{world_size} ranks wrote "
                f"their part within {timeout_s:.0f} s"
            )
        time.sleep(0.02)


class CheckpointWriter:
    """Runs the write + commit protocol for one rank, inline or on a one-thread
    executor (`async_save`). At most one checkpoint is in flight per rank; rank 0's
    commits are collected with `completed()` on the main thread."""

    def __init__(
        self,
        root: Path,
        rank: int,
        world_size: int,
        keep_last: int,
        keep_best: int,
        async_save: bool,
        after_commit: Callable[[], None] | None = None,
        store: Any = None,
        orphaned: Callable[[], str | None] | None = None,
    ):
        """`after_commit`: called on rank 0 after each commit and pruning.
        `store`: a `trainlab.train.checkpoint.store.CheckpointStore` when the run
        lives in object storage: every rank uploads its part there and rank 0
        commits there (`root` is then this node's scratch for staging).
        `orphaned`: asked by rank 0 right before each commit; a reason (the driver
        that started this group is gone, or another holds the run) raises
        `Orphaned` instead of committing."""
        self.root, self.rank, self.world_size = root, rank, world_size
        self.after_commit = after_commit
        self.orphaned = orphaned
        self.store = store
        self.keep_last, self.keep_best = keep_last, keep_best
        self._executor = ThreadPoolExecutor(1, "checkpoint") if async_save else None
        self._future: Future[CheckpointInfo | None] | None = None
        self._done: list[CheckpointInfo] = []

    def staging_dir(self, step: int) -> Path:
        if self.store is not None:  # this rank's own folder on its node's scratch
            path = self.store.staging_dir(step, self.rank)
        else:
            path = self.root / f"{STAGING_PREFIX}{dir_name(step)}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _check_driver(self, step: int) -> None:
        """Rank 0, right before the commit of `step`: `Orphaned` when this group's
        driver is gone (its partial checkpoint stays uncommitted: a resume cleans it)."""
        reason = self.orphaned() if self.orphaned is not None else None
        if reason is not None:
            raise Orphaned(f"not committing step {step}: {reason}")

    def discard(self, step: int) -> None:
        """Remove the partial checkpoint of `step` (its staging directory)."""
        if self.store is not None:
            shutil.rmtree(self.store.staging_dir(step, self.rank), ignore_errors=True)
            return
        shutil.rmtree(self.root / f"{STAGING_PREFIX}{dir_name(step)}", ignore_errors=True)

    def fault(self, step: int, error: BaseException) -> BaseException:
        """What a failed write of checkpoint `step` raises: a `StorageFault` when an
        OSError is behind it (its partial checkpoint removed first), else `error`."""
        if isinstance(error, StorageFault):
            return error
        cause = os_error_in(error)
        if cause is None:
            return error
        self.discard(step)
        return StorageFault(f"saving step {step}", cause, step)

    def submit(
        self,
        step: int,
        write_files: Callable[[Path], None],
        meta: dict[str, Any],
        validator: Validator | None,
    ) -> None:
        """Write this rank's part of checkpoint `step` with `write_files(staging)`;
        rank 0 then commits. Waits for the previous checkpoint of this rank first."""
        self.wait()
        staging = self.staging_dir(step)

        def write() -> CheckpointInfo | None:
            write_files(staging)
            if self.store is not None:
                return self._to_store(step, staging, meta, validator)
            write_done_marker(staging, self.rank)
            if self.rank != 0:
                return None
            wait_for_ranks(staging, self.world_size)
            self._check_driver(step)
            info = commit(staging, self.root / dir_name(step), meta, validator)
            prune(self.root, self.keep_last, self.keep_best)
            if self.after_commit is not None:
                self.after_commit()
            return info

        def work() -> CheckpointInfo | None:
            try:
                return write()
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException too
                fault = self.fault(step, e)
                if fault is e:
                    raise
                raise fault from e

        if self._executor is None:
            self._collect(work())
        else:
            self._future = self._executor.submit(work)

    def _to_store(
        self, step: int, staging: Path, meta: dict[str, Any], validator: Validator | None
    ) -> CheckpointInfo | None:
        """Upload this rank's part; on rank 0, wait for every part, validate a
        complete local copy and commit in the store (trainlab.train.checkpoint.store).
        A failure of the store gives up this save only (logged, never committed)."""
        from trainlab.train.checkpoint.store import SaveAbandoned, abandoned_text

        store = self.store
        try:
            try:
                own = store.upload_part(staging, step, self.rank)
            except Exception as e:
                store.mark_part_failed(step, self.rank, first_line_of(e))
                raise SaveAbandoned(f"rank {self.rank}: {first_line_of(e)}") from e
            if self.rank != 0:
                shutil.rmtree(staging, ignore_errors=True)
                return None
            files = store.wait_parts(step, self.world_size)
            if validator is not None:  # validation reads the whole checkpoint
                store.download(step, files, staging, skip=set(own))
            full = committed_meta(staging, meta, files, validator)
            self._check_driver(step)
            store.commit(step, full)
        except (SaveAbandoned, OSError, ValueError) as e:
            log.warning("%s", abandoned_text(step, store, e))
            shutil.rmtree(staging, ignore_errors=True)
            if self.rank == 0:
                store.delete(step)
            return None
        final = store.local_root / dir_name(step)  # this node's cache of the newest
        remove_checkpoint(final)
        if validator is not None:  # a complete, checked copy: what a resume here reads
            from trainlab.train.checkpoint.store import VERIFIED

            full = json.loads(json.dumps(full))  # as a reader of the store sees it
            (staging / META_FILE).write_text(json.dumps(full, indent=1, sort_keys=True))
            (staging / VERIFIED).write_text(json.dumps(full, sort_keys=True))
            staging.rename(final)
        else:
            shutil.rmtree(staging, ignore_errors=True)
        store.keep_cache(step)
        try:
            store.prune(self.keep_last, self.keep_best)
        except OSError as e:
            log.warning("retention in %s failed (tried again next save): %s", store.uri(), e)
        if self.after_commit is not None:
            self.after_commit()
        return CheckpointInfo(final, step, full, uri=store.uri(step))

    def _collect(self, info: CheckpointInfo | None) -> None:
        if info is not None:
            self._done.append(info)

    def wait(self) -> None:
        """Block until this rank's checkpoint in flight is written (and, on rank 0,
        committed); re-raise its error."""
        future, self._future = self._future, None
        if future is None:
            return
        try:
            self._collect(future.result())
        except StorageFault:
            raise  # the disk failed it: recorded as such, never retried in place
        except Exception as e:
            raise RuntimeError(f"writing a checkpoint failed: {e}") from e

    def abandon(self) -> None:
        """After a fault: let the save in flight end, its outcome ignored, so the
        cleanup that follows removes its staging after its writer stopped."""
        future, self._future = self._future, None
        if future is not None:
            with contextlib.suppress(BaseException):
                future.result()

    def completed(self) -> list[CheckpointInfo]:
        """Checkpoints committed since the last call (rank 0)."""
        if self._future is not None and self._future.done():
            self.wait()
        out, self._done = self._done, []
        return out


# --------------------------------------------------------------------------- catalogs


class LocalCatalog:
    """The checkpoints of a run in a directory (local or shared), with the same
    methods as a run's in object storage (`store.CheckpointStore`)."""

    def __init__(self, root: Path):
        self.root = root

    def committed(self) -> list[CheckpointInfo]:
        return committed(self.root)

    def find_resume(self, require_valid: bool = True) -> CheckpointInfo | None:
        return find_resume(self.root, require_valid)

    def refusals(self, require_valid: bool = True) -> list[tuple[str, str]]:
        return [(str(p), why) for p, why in refusals(self.root, require_valid)]

    def prune(self, keep_last: int, keep_best: int) -> list[int]:
        return [parse_step(p.name) or 0 for p in prune(self.root, keep_last, keep_best)]


def catalog(loc: Any) -> Any:
    """The checkpoints of the run at `loc` (a `trainlab.runloc.RunLocation`): a
    `LocalCatalog`, or a `store.CheckpointStore` for a run in object storage."""
    if loc.remote:
        from trainlab.train.checkpoint.store import CheckpointStore

        return CheckpointStore(loc)
    return LocalCatalog(loc.local / "checkpoints")
