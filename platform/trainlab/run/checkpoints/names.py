"""What the files and folders of a checkpoint are called (the layout is drawn in
trainlab.run.checkpoints's docstring)."""

from __future__ import annotations

META_FILE = "checkpoint.json"
FORMAT_VERSION = 1
PREFIX = "step-"
STAGING_PREFIX = ".tmp-"
PULL_PREFIX = ".pull-"  # a checkpoint being fetched from object storage (checkpoint.store)
TRASH_PREFIX = ".trash-"  # a checkpoint retention is deleting (`remove_checkpoint`)
DONE_PREFIX = ".done-rank"


def dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    if not name.startswith(PREFIX):
        return None
    digits = name[len(PREFIX) :]
    return int(digits) if digits.isdigit() else None
