"""This node's disk as trainlab uses it besides the locations themselves
(trainlab.location reaches every place: local, shared, S3, GCS):

- `scratch_root()`: this node's scratch and cache area;
- `resolve_inside(root, name)`: a name read from storage, a manifest or a
  checkpoint's metadata, as a path that stays inside `root` (no `..`, not
  absolute, no symlink leading out), else `UnsafePath`;
- `check_disk_room(run_dir, checkpoint_cfg, num_params)`: the preflight before
  a run starts: the run directory's filesystem holds keep_last + keep_best + 1
  checkpoints of the planned size, else a `UserError` with the numbers (a run
  in object storage has no disk to fill).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, TypeVar

from trainlab.errors import UserError

if TYPE_CHECKING:
    from trainlab.location import Location

log = logging.getLogger(__name__)
T = TypeVar("T")

SCRATCH_ENV_VAR = "TRAINLAB_SCRATCH_DIR"


def scratch_root(configured: str | None = None) -> Path:
    """This node's scratch and cache area: `resource.scratch_dir`, else
    $TRAINLAB_SCRATCH_DIR, else {the node's temp dir}/trainlab-scratch (TMPDIR
    decides the temp dir, so raylets started with their own TMPDIR get their own
    scratch). Created on first use. Nothing here is the only copy of anything."""
    import tempfile

    text = configured or os.environ.get(SCRATCH_ENV_VAR)
    root = Path(text).expanduser() if text else Path(tempfile.gettempdir()) / "trainlab-scratch"
    root.mkdir(parents=True, exist_ok=True)
    return root


class UnsafePath(ValueError):
    """A name read from storage, a manifest or a checkpoint leads outside its root."""


def resolve_inside(root: str | os.PathLike[str], name: object, what: str = "name") -> Path:
    """`root / name` for a `name` written by someone else (a storage copy's
    checkpoint.json, a manifest): a non-empty relative POSIX path without `..`
    whose resolved location, symlinks followed, stays inside `root`'s. Raises
    `UnsafePath` naming `what` and the name otherwise."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise UnsafePath(f"{what} {name!r} is not a plain relative file name")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts or name.startswith("~"):
        raise UnsafePath(f"{what} {name!r} leads outside {root}")
    base = Path(root)
    target = base.joinpath(*parts)
    real_root, real = base.resolve(), target.resolve()
    if real != real_root and real_root not in real.parents:
        raise UnsafePath(f"{what} {name!r} leads outside {root} (through a symlink, to {real})")
    return target


# --------------------------------------------------------------------------- disk room

# A checkpoint holds the fp32 weights and the optimizer's state (AdamW: two fp32
# moments, 12 bytes per parameter in all; each optimizer states its figure,
# trainlab.optim) plus the trainer state and every rank's RNG (well under this
# allowance).
CHECKPOINT_BYTES_PER_PARAM = 12  # AdamW's: the default when no figure is given
CHECKPOINT_OVERHEAD_BYTES = 1 << 20


def planned_checkpoint_bytes(
    num_params: int, bytes_per_param: float = CHECKPOINT_BYTES_PER_PARAM
) -> int:
    """The size on disk of one checkpoint of a model with `num_params` parameters."""
    return int(bytes_per_param * int(num_params)) + CHECKPOINT_OVERHEAD_BYTES


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_disk_room(
    run_dir: str | os.PathLike[str] | Location,
    checkpoint_cfg: Any,
    num_params: int,
    bytes_per_param: float = CHECKPOINT_BYTES_PER_PARAM,
) -> None:
    """Refuse to start a run whose directory's filesystem cannot hold
    `keep_last + keep_best + 1` checkpoints (the retained ones and the one being
    written) of the planned size; the checkpoints already in the run directory
    count as room taken. A run in object storage has no disk to fill: nothing is
    asked of the store (`Location.free_bytes`). `checkpoint_cfg`: the config's
    `train.checkpoint`."""
    from trainlab.location import locate

    run = locate(run_dir, what="train.runs_root")
    keep_last, keep_best = int(checkpoint_cfg.keep_last), int(checkpoint_cfg.keep_best)
    count = keep_last + keep_best + 1
    size = planned_checkpoint_bytes(num_params, bytes_per_param)
    free = run.free_bytes()
    if count * size <= free:  # fits even with nothing there yet: nothing to count
        return
    have = sum(n for _, n in run.walk("checkpoints"))
    need = max(0, count * size - have)
    if need <= free:
        return
    raise UserError(
        f"train.runs_root: the filesystem of {run.uri} has {gib(free)} free; "
        f"{count} checkpoints (train.checkpoint.keep_last {keep_last} + keep_best "
        f"{keep_best} + 1 being written) of {gib(size)} each ({num_params:,} parameters x "
        f"{bytes_per_param:.4g} bytes) need {gib(need)} more"
        + (f" (besides the {gib(have)} of checkpoints already there)" if have else "")
        + "; free space, lower keep_last/keep_best or set train.runs_root to a larger disk"
    )
