"""Small file helpers shared by every part that writes records (torch-free)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_text_atomic(path: Path, text: str, fsync: bool = False) -> None:
    """Write `text` to `path` through a temporary file renamed into place, so a
    reader sees either the old file or the new one, never half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    tmp.replace(path)
