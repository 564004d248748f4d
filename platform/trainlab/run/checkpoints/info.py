"""One checkpoint and its record (checkpoint.json): `CheckpointInfo`, reading it
from a folder, and what the record says about resuming from it (its format and
config, its data position)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainlab.run.checkpoints.names import META_FILE, parse_step


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
