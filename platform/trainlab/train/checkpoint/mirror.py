"""A durable copy of a run's valid checkpoints on `resource.storage`.

The run directory (`train.runs_root`) is where checkpoints are written and
committed (every rank writes its part there, so on many nodes it is a shared
filesystem). With `resource.storage` set (an `s3://bucket/prefix` URI with an
endpoint override, or another path), rank 0 also copies each checkpoint that
passed validation to

    {storage}/{date}/{name}/checkpoints/step-NNNNNNNN/

payload files first and `checkpoint.json` last, so a copy cut off midway has
no metadata and is never taken for a checkpoint. Retention applies to the copy
as to the run directory. When a run starts and the run directory has no valid
checkpoint as new as the newest copy (a new cluster, a lost disk), the newest
copies are downloaded into the run directory first, checked against their
sha256 like any checkpoint, and the run resumes from them.

A storage outage never stops training: a failed copy is logged and retried
with the next checkpoint, which copies everything retention keeps.

A copy is untrusted input: whoever can write to the storage wrote it. Every
file name in its checkpoint.json must be a plain relative name that stays inside
the copy and inside the local checkpoint (no `..`, not absolute, no symlink
leading out, on a local or shared filesystem storage); otherwise the whole copy
is refused, before anything is written, with a `UserError` naming the copy and
the name (docs/security.md). The same holds for the names a local checkpoint
lists when it is pushed.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from trainlab.errors import UserError, first_line
from trainlab.storage import UnsafePath, resolve_inside
from trainlab.train import checkpoint as ck

log = logging.getLogger(__name__)


class CheckpointMirror:
    def __init__(self, storage: Any, run_key: str):
        """`storage`: a resolved `trainlab.storage.Storage`; `run_key`: the run
        directory relative to the runs root (`{date}/{name}`)."""
        self.storage, self.run_key = storage, run_key.strip("/")
        self.fs = storage.filesystem
        self.root = storage.join(self.run_key, "checkpoints")

    @classmethod
    def for_run(cls, location: str, run_dir: Path) -> CheckpointMirror:
        from trainlab.storage import resolve_storage

        return cls(resolve_storage(location), f"{run_dir.parent.name}/{run_dir.name}")

    def uri(self, step: int | None = None) -> str:
        parts = [self.run_key, "checkpoints", *([ck.dir_name(step)] if step is not None else [])]
        return self.storage.uri_of(*parts)

    # ------------------------------------------------------------------ listing

    def steps(self) -> list[int]:
        """Steps with a complete copy (its checkpoint.json present), oldest first."""
        from pyarrow import fs

        try:
            entries = self.fs.get_file_info(fs.FileSelector(self.root, allow_not_found=True))
        except OSError as e:
            log.warning("checkpoint copies at %s cannot be listed: %s", self.uri(), e)
            return []
        out = []
        for entry in entries:
            step = ck.parse_step(entry.base_name)
            if step is None or entry.type != fs.FileType.Directory:
                continue
            meta = self.fs.get_file_info(f"{entry.path}/{ck.META_FILE}")
            if meta.type == fs.FileType.File:
                out.append(step)
        return sorted(out)

    # ------------------------------------------------------------------ writing

    def push(self, info: ck.CheckpointInfo) -> None:
        """Copy one committed checkpoint: every file listed in its metadata, then
        the metadata itself."""
        dest = f"{self.root}/{ck.dir_name(info.step)}"
        files = sorted(info.meta.get("files", {}))
        what = "file name in checkpoint.json"
        sources = [resolve_inside(info.path, rel, what) for rel in files]
        for rel, src in zip(files, sources, strict=True):
            self._upload(src, f"{dest}/{rel}")
        self._upload(info.path / ck.META_FILE, f"{dest}/{ck.META_FILE}")

    def _upload(self, src: Path, dest: str) -> None:
        parent = dest.rsplit("/", 1)[0]
        if self.storage.kind == "local":
            self.fs.create_dir(parent, recursive=True)
        with open(src, "rb") as f, self.fs.open_output_stream(dest) as out:
            shutil.copyfileobj(f, out, 8 << 20)

    def sync(self, local_root: Path, keep_last: int, keep_best: int) -> list[int]:
        """Make the copy hold what retention keeps of the valid checkpoints in
        `local_root`: push the missing ones, delete the copies no longer kept.
        Returns the steps pushed."""
        local = [i for i in ck.committed(local_root) if i.valid]
        keep = ck.retained_steps(local, keep_last, keep_best)
        present = set(self.steps())
        pushed = []
        for info in local:
            if info.step in keep and info.step not in present:
                self.push(info)
                pushed.append(info.step)
        for step in present - keep:
            if local and step < local[-1].step:  # never a copy newer than what we have
                self.fs.delete_dir(f"{self.root}/{ck.dir_name(step)}")
        return pushed

    def safe_sync(self, local_root: Path, keep_last: int, keep_best: int) -> None:
        """`sync`, logging instead of raising: an outage never stops training."""
        try:
            pushed = self.sync(local_root, keep_last, keep_best)
        except Exception as e:  # noqa: BLE001 - an outage must not stop training
            log.warning(
                "copying checkpoints to %s failed (retried next time): %s",
                self.uri(),
                first_line(e),
            )
            return
        for step in pushed:
            log.info("checkpoint step %d copied to %s", step, self.uri(step))

    # ------------------------------------------------------------------ restoring

    def pull(self, local_root: Path, require_valid: bool = True) -> list[int]:
        """Download the copies newer than the newest valid local checkpoint (newest
        first, stopping at the first that arrives intact); return the steps
        restored."""
        have = ck.find_resume(local_root, require_valid=require_valid)
        newer = [s for s in self.steps() if have is None or s > have.step]
        for step in reversed(newer):
            if self._download(step, local_root, require_valid):
                return [step]
        return []

    def _download(self, step: int, local_root: Path, require_valid: bool) -> bool:
        src = f"{self.root}/{ck.dir_name(step)}"
        staging = local_root / f"{ck.PULL_PREFIX}{ck.dir_name(step)}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            with self.fs.open_input_stream(f"{src}/{ck.META_FILE}") as f:
                meta = json.loads(f.read())
            if not isinstance(meta, dict):
                raise ValueError("checkpoint.json is not a JSON object")
            if require_valid and meta.get("valid") is not True:
                raise ValueError("the copy is not marked valid")
            files = self._checked_names(step, meta, staging)  # before writing anything
            for rel, target in files:
                target.parent.mkdir(parents=True, exist_ok=True)
                with self.fs.open_input_stream(f"{src}/{rel}") as inp, open(target, "xb") as out:
                    shutil.copyfileobj(inp, out, 8 << 20)
            (staging / ck.META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
            info = ck.read_info_at(staging, step)
            problem = ck.verify(info) if info else "unreadable checkpoint.json"
            if problem:
                raise ValueError(problem)
        except UnsafePath as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise UserError(
                f"refusing the checkpoint copy {self.uri(step)}: {e}; nothing was restored. "
                "Whoever can write to the storage wrote this copy: check who can, and "
                "delete the copy"
            ) from None
        except (OSError, ValueError) as e:
            log.warning("skipping the copy %s: %s", self.uri(step), e)
            shutil.rmtree(staging, ignore_errors=True)
            return False
        final = local_root / ck.dir_name(step)
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        log.warning("restored checkpoint step %d from %s", step, self.uri(step))
        return True

    def _checked_names(
        self, step: int, meta: dict[str, Any], staging: Path
    ) -> list[tuple[str, Path]]:
        """(name, local target) of every file the copy lists, each checked to stay
        inside the local staging directory and, on a filesystem storage, inside the
        copy itself (symlinks followed); `UnsafePath` for the first that does not."""
        files = meta.get("files")
        if not isinstance(files, dict) or not files:
            raise ValueError("checkpoint.json lists no files")
        what = "file name in checkpoint.json"
        out = []
        copy_dir = Path(f"{self.root}/{ck.dir_name(step)}")
        for rel in sorted(files, key=str):
            if rel == ck.META_FILE:
                raise UnsafePath(f"{what} {rel!r} would overwrite the metadata")
            if self.storage.kind == "local":
                resolve_inside(self.root, ck.dir_name(step), "the copy's directory")
                resolve_inside(copy_dir, rel, what)
            out.append((rel, resolve_inside(staging, rel, what)))
        return out
