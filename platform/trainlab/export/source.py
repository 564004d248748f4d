"""Which checkpoint to export, and its model tensors read one at a time.

A path is a run directory (`{runs_root}/{date}/{name}/`, holding config.yaml
and checkpoints/) or one checkpoint directory in it (`checkpoints/step-N/`).
The run's newest valid checkpoint whose files match their checksums is taken
(`trainlab.run.checkpoints.find_resume`), or the one of `step`.

The checkpoint (trainlab.train.loop.checkpointer) is read without the training
layout or a process group: `state/` holds torch.distributed.checkpoint shards,
the model's entries under `model.<name>` with the same names as the unsharded
model's state dict, whatever the layout (FSDP, tensor or pipeline
parallelism); each is read alone from the metadata's description, so host
memory stays near the largest tensor.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from trainlab.config import ExperimentConfig
from trainlab.config.loader import validate_raw
from trainlab.errors import UserError
from trainlab.run import checkpoints as ckpts
from trainlab.train.loop.checkpointer import DCP_DIR

MODEL_PREFIX = "model."


@dataclass(frozen=True)
class Located:
    run_dir: Path  # on this machine (a run in object storage: its working copy)
    checkpoint: ckpts.CheckpointInfo
    cfg: ExperimentConfig
    where: str = ""  # the run as records name it (its URI, or its directory)

    @property
    def run(self) -> str:
        """The run as records name it: its URI, else its directory."""
        return self.where or str(self.run_dir)


def _run_config(run_dir: Path) -> ExperimentConfig:
    path = run_dir / "config.yaml"
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: not found; is {run_dir} a trainlab run directory?") from None
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"{path}: cannot read the run's config ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: top level must be a mapping")
    return validate_raw(raw, source=str(path))


def locate(path: str | Path, step: int | None = None) -> Located:
    """The run, checkpoint and config that `path` (a run or one of its checkpoints,
    `{run}/checkpoints/step-N`, in a directory or in object storage) and `step`
    name; UserError when there is none. The checkpoint is the run's newest valid
    one, or the one of `step`, read where this node reads checkpoints (in place on
    a disk; from a store, fetched into this node's cache and sha256-checked)."""
    from trainlab.location import locate as locate_place
    from trainlab.run.location import RunLocation

    run = RunLocation.of(locate_place(path, what="the run").resolved())
    named = ckpts.parse_step(run.home.name)
    if named is not None and run.home.is_file(ckpts.META_FILE):  # one checkpoint
        if step is not None and step != named:
            raise UserError(f"--step {step}: {run.uri} is the checkpoint of step {named}")
        checkpoint, step = run.uri, named
        run = RunLocation.of(run.home.parent.parent, what="the run")
    else:
        checkpoint = None
    if not run.fetch("config.yaml"):
        if not run.home.exists():
            raise UserError(f"{path}: no such directory (give a run directory or a checkpoint)")
        raise UserError(f"{run.uri}: no config.yaml there; give a run or one of its checkpoints")
    cfg = _run_config(run.local)
    catalog = ckpts.catalog(run)
    if step is None:
        info = catalog.fetch_newest(require_valid=cfg.train.checkpoint.validate)
        if info is None:
            raise UserError(f"{catalog.uri()}: no valid checkpoint to export")
        return Located(run.local, info, cfg, where=run.uri)
    match = [i for i in catalog.committed() if i.step == step]
    if not match and checkpoint is not None:
        raise UserError(f"{checkpoint}: unreadable {ckpts.META_FILE} (not a committed checkpoint)")
    if not match:
        have = ", ".join(str(i.step) for i in catalog.committed()) or "none"
        raise UserError(f"--step {step}: {catalog.uri()} has no checkpoint of that step "
                        f"(steps: {have})")  # fmt: skip
    try:
        info = catalog.fetch(match[0])
    except ValueError as e:
        raise UserError(f"{catalog.uri(step)}: {e}") from None
    return Located(run.local, _checked(info), cfg, where=run.uri)


def _checked(info: ckpts.CheckpointInfo) -> ckpts.CheckpointInfo:
    """`info` when it is valid and intact (the same rules as resuming)."""
    if info.meta.get("validated") and not info.valid:
        reason = info.meta.get("error") or "it failed validation"
        raise UserError(f"{info.path}: not a valid checkpoint ({reason})")
    problem = ckpts.verify(info)
    if problem:
        raise UserError(f"{info.path}: {problem}")
    return info


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


class CheckpointTensors:
    """The model's tensors in one checkpoint, by their state-dict name; `get`
    reads one tensor (fp32 CPU as stored)."""

    def __init__(self, info: ckpts.CheckpointInfo):
        self.path = info.path
        self.format = info.meta.get("format")
        if self.format != ckpts.FORMAT:
            raise UserError(
                f"{info.path}: checkpoint format {self.format!r}, which this trainlab does "
                f"not read (it reads {ckpts.FORMAT!r}: torch.distributed.checkpoint)"
            )
        self.specs = self._dcp_specs()

    def _dcp_specs(self) -> dict[str, TensorSpec]:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = FileSystemReader(str(self.path / DCP_DIR)).read_metadata()
        out = {}
        for key, md in meta.state_dict_metadata.items():
            if key.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata):
                out[key[len(MODEL_PREFIX) :]] = TensorSpec(tuple(md.size), md.properties.dtype)
        if not out:
            raise UserError(f"{self.path / DCP_DIR}: holds no model tensors")
        return out

    def get(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        import torch.distributed.checkpoint as dcp

        tensor = torch.empty(spec.shape, dtype=spec.dtype)
        state: dict[str, Any] = {"model": {name: tensor}}
        with warnings.catch_warnings():  # "assuming ... a single process": it is one
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(self.path / DCP_DIR), no_dist=True)
        return state["model"][name]
