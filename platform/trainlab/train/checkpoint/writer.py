"""One rank's saves: `CheckpointWriter` runs the write and commit protocol inline
or in a background thread (`async_save`), for every location: what differs is
its target's staging folder and commit, into a directory (`_DirTarget`:
trainlab.train.checkpoint.disk) or a run in object storage (`_StoreTarget`:
trainlab.run.checkpoints.store). A write the storage fails becomes a
`StorageFault`, and a group whose driver is gone commits nothing (`Orphaned`)."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainlab.run.checkpoints.info import CheckpointInfo
from trainlab.run.checkpoints.local import prune, remove_checkpoint
from trainlab.run.checkpoints.names import META_FILE, STAGING_PREFIX, dir_name
from trainlab.run.checkpoints.store import CheckpointStore
from trainlab.run.checkpoints.validation import Validator, committed_meta
from trainlab.train.checkpoint.disk import commit, wait_for_ranks, write_done_marker
from trainlab.train.checkpoint.faults import Orphaned, StorageFault, first_line_of, os_error_in

# The package's logger, as before its split into modules.
log = logging.getLogger("trainlab.train.checkpoint")


class _DirTarget:
    """Commits into a directory every rank sees (trainlab.train.checkpoint.disk):
    each rank's done marker in the shared staging directory, then rank 0 renames
    it into place."""

    def __init__(self, root: Path, keep_last: int, keep_best: int):
        self.root, self.keep_last, self.keep_best = root, keep_last, keep_best

    def staging_dir(self, step: int, rank: int) -> Path:
        return self.root / f"{STAGING_PREFIX}{dir_name(step)}"

    def finish(
        self,
        writer: CheckpointWriter,
        step: int,
        staging: Path,
        meta: dict[str, Any],
        validator: Validator | None,
    ) -> CheckpointInfo | None:
        write_done_marker(staging, writer.rank)
        if writer.rank != 0:
            return None
        wait_for_ranks(staging, writer.world_size)
        writer.check_driver(step)
        info = commit(staging, self.root / dir_name(step), meta, validator)
        prune(self.root, self.keep_last, self.keep_best)
        return info


class _StoreTarget:
    """Commits into a run in object storage (trainlab.run.checkpoints.store): each
    rank stages on its node's scratch and uploads its part; rank 0 waits for every
    part, validates a complete local copy and writes checkpoint.json last. A
    failure of the store gives up this save only (logged, never committed)."""

    def __init__(self, store: Any, keep_last: int, keep_best: int):
        self.store, self.keep_last, self.keep_best = store, keep_last, keep_best

    def staging_dir(self, step: int, rank: int) -> Path:
        return self.store.staging_dir(step, rank)  # on this node's scratch

    def finish(
        self,
        writer: CheckpointWriter,
        step: int,
        staging: Path,
        meta: dict[str, Any],
        validator: Validator | None,
    ) -> CheckpointInfo | None:
        from trainlab.run.checkpoints.store import VERIFIED, SaveAbandoned, abandoned_text

        store, rank = self.store, writer.rank
        try:
            try:
                own = store.upload_part(staging, step, rank)
            except Exception as e:
                store.mark_part_failed(step, rank, first_line_of(e))
                raise SaveAbandoned(f"rank {rank}: {first_line_of(e)}") from e
            if rank != 0:
                shutil.rmtree(staging, ignore_errors=True)
                return None
            files = store.wait_parts(step, writer.world_size)
            if validator is not None:  # validation reads the whole checkpoint
                store.download(step, files, staging, skip=set(own))
            full = committed_meta(staging, meta, files, validator)
            writer.check_driver(step)
            store.commit(step, full)
        except (SaveAbandoned, OSError, ValueError) as e:
            log.warning("%s", abandoned_text(step, store, e))
            shutil.rmtree(staging, ignore_errors=True)
            if rank == 0:
                store.delete(step)
            return None
        final = store.local_root / dir_name(step)  # this node's cache of the newest
        remove_checkpoint(final)
        if validator is not None:  # a complete, checked copy: what a resume here reads
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
        return CheckpointInfo(final, step, full, uri=store.uri(step))


class CheckpointWriter:
    """Runs the write + commit protocol for one rank, inline or on a one-thread
    executor (`async_save`), into the run's directory or its object store (the
    target: the only part that differs). At most one checkpoint is in flight per
    rank; rank 0's commits are collected with `completed()` on the main thread."""

    def __init__(
        self,
        root: Path,
        rank: int,
        world_size: int,
        keep_last: int,
        keep_best: int,
        async_save: bool,
        after_commit: Callable[[], None] | None = None,
        catalog: Any = None,
        orphaned: Callable[[], str | None] | None = None,
    ):
        """`after_commit`: called on rank 0 after each commit and pruning.
        `catalog`: the run's (trainlab.run.checkpoints.catalog); a `CheckpointStore`
        when the run lives in object storage: every rank uploads its part there and
        rank 0 commits there (`root` is then this node's scratch for staging).
        Otherwise the checkpoints are committed into `root`.
        `orphaned`: asked by rank 0 right before each commit; a reason (the driver
        that started this group is gone, or another holds the run) raises
        `Orphaned` instead of committing."""
        self.rank, self.world_size = rank, world_size
        self.after_commit = after_commit
        self.orphaned = orphaned
        self.target = (
            _StoreTarget(catalog, keep_last, keep_best)
            if isinstance(catalog, CheckpointStore)
            else _DirTarget(root, keep_last, keep_best)
        )
        self._executor = ThreadPoolExecutor(1, "checkpoint") if async_save else None
        self._future: Future[CheckpointInfo | None] | None = None
        self._done: list[CheckpointInfo] = []

    def staging_dir(self, step: int) -> Path:
        path = self.target.staging_dir(step, self.rank)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def check_driver(self, step: int) -> None:
        """Rank 0, right before the commit of `step`: `Orphaned` when this group's
        driver is gone (its partial checkpoint stays uncommitted: a resume cleans it)."""
        reason = self.orphaned() if self.orphaned is not None else None
        if reason is not None:
            raise Orphaned(f"not committing step {step}: {reason}")

    def discard(self, step: int) -> None:
        """Remove the partial checkpoint of `step` (its staging directory)."""
        shutil.rmtree(self.target.staging_dir(step, self.rank), ignore_errors=True)

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

        def work() -> CheckpointInfo | None:
            try:
                write_files(staging)
                info = self.target.finish(self, step, staging, meta, validator)
                if info is not None and self.after_commit is not None:
                    self.after_commit()
                return info
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException too
                fault = self.fault(step, e)
                if fault is e:
                    raise
                raise fault from e

        if self._executor is None:
            self._collect(work())
        else:
            self._future = self._executor.submit(work)

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
