"""The checkpoints of a run in a directory (local or shared): the committed ones,
which one a resume takes, retention, and removal that a kill cannot leave half
done. `LocalCatalog` has the methods of a run's in object storage
(`store.CheckpointStore`); trainlab.run.checkpoints.catalog(loc) picks one."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from trainlab.run.checkpoints.info import CheckpointInfo, read_info
from trainlab.run.checkpoints.names import (
    META_FILE,
    PULL_PREFIX,
    STAGING_PREFIX,
    TRASH_PREFIX,
    dir_name,
    parse_step,
)
from trainlab.run.checkpoints.validation import verify

# The checkpoint package's logger, as before its split into modules and the
# catalog's move out of trainlab.train.checkpoint (the same logger for log filters).
log = logging.getLogger("trainlab.train.checkpoint")


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


# --------------------------------------------------------------------------- the catalog


class LocalCatalog:
    """The checkpoints of a run in a directory (local or shared), with the same
    methods as a run's in object storage (`store.CheckpointStore`): a resume
    reads them in place (`fetch` returns the run's own folder)."""

    def __init__(self, root: Path):
        self.root = root

    @property
    def local_root(self) -> Path:
        """Where this node reads checkpoints from: the run's own folder."""
        return self.root

    def uri(self, step: int | None = None) -> str:
        return str(self.root if step is None else self.root / dir_name(step))

    def clean_uncommitted(self) -> list[int]:
        """Half-written and half-deleted checkpoints of a crashed attempt, removed
        (rank 0, at start); their steps are not known here: []."""
        clean_staging(self.root)
        return []

    def fetch_newest(self, require_valid: bool = True) -> CheckpointInfo | None:
        return find_resume(self.root, require_valid)

    def fetch(self, info: CheckpointInfo) -> CheckpointInfo:
        """Checkpoint `info` where this node reads it: in place."""
        return CheckpointInfo(self.root / dir_name(info.step), info.step, info.meta)

    def committed(self) -> list[CheckpointInfo]:
        return committed(self.root)

    def find_resume(self, require_valid: bool = True) -> CheckpointInfo | None:
        return find_resume(self.root, require_valid)

    def refusals(self, require_valid: bool = True) -> list[tuple[str, str]]:
        return [(str(p), why) for p, why in refusals(self.root, require_valid)]

    def prune(self, keep_last: int, keep_best: int) -> list[int]:
        return [parse_step(p.name) or 0 for p in prune(self.root, keep_last, keep_best)]

    def delete(self, step: int) -> None:
        """Remove a step folder, never leaving a half-deleted one under its name."""
        remove_checkpoint(self.root / dir_name(step))
