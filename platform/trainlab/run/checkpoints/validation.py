"""Whether a checkpoint is good: the outcome of validating it (a `Validator` run
on its complete files before the commit), recorded in its checkpoint.json with
every file's size and sha256 (`committed_meta`), and its files checked against
that list before a resume takes it (`verify`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainlab.fileutil import sha256_file
from trainlab.run.checkpoints.info import CheckpointInfo
from trainlab.run.checkpoints.names import FORMAT_VERSION


@dataclass
class Validation:
    ok: bool
    loss: float | None = None
    error: str | None = None


Validator = Callable[[Path], Validation]


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
