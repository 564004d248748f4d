"""The commit protocol in a directory (the rename is the commit): every rank
writes its files into the staging directory (`save_file`: fsynced) and then its
done marker; rank 0 waits for every marker (`wait_for_ranks`), hashes and
validates the files, writes checkpoint.json last and renames the directory into
place (`commit`). Also `load_file`, the one way a checkpoint's files are read."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from trainlab.fileutil import sha256_file
from trainlab.run.checkpoints.info import CheckpointInfo
from trainlab.run.checkpoints.local import remove_checkpoint
from trainlab.run.checkpoints.names import DONE_PREFIX, META_FILE
from trainlab.run.checkpoints.validation import Validator, committed_meta


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
