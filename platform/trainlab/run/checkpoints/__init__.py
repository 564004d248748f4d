"""A run's checkpoints as its readers see them: names, records, validation,
the catalog (which are committed, which one a resume takes) and retention.
Torch-free: gc, track and export list checkpoints without the training layer;
writing them (the commit protocol, the async writer) is trainlab.train.checkpoint.

Layout under `{run_dir}/checkpoints/`:

    step-00000020/              a committed checkpoint (the rename is the commit)
      checkpoint.json           written last: step, files + sha256, valid, val_loss, ...
      trainer.pt                step, data position, config hash, dataset fingerprint
      rng-rank0.pt ...          RNG of Python, NumPy, torch (CUDA) of every rank
      state/                    torch.distributed.checkpoint (DCP) shards, every layout
    .tmp-step-00000040/         being written; never read, removed on the next start
                                (and at once when its write fails: `StorageFault`)

A checkpoint is committed once its checkpoint.json is in place, with every
file's size and sha256 and the outcome of validating it (`committed_meta`).
Retention keeps the keep_last newest valid checkpoints and the keep_best valid
ones of lowest val_loss (`retained_steps`, `prune`).

Why not Ray Train's own checkpoint registry (`ray.train.report(checkpoint=)`):
its run snapshot refuses to restore once a checkpoint it recorded is deleted by
our retention, and `get_checkpoint()` returns the newest reported checkpoint
whether or not it loads. Resume here picks the newest checkpoint that is marked
valid AND whose files still match their checksums, warning about each one skipped.

`catalog(loc)` gives the checkpoints of any run: a `LocalCatalog`, or a
`store.CheckpointStore` (same methods) for a run in object storage.

The modules, by role (every public name but the store's is re-exported here):

    names.py       what the files and folders are called (dir_name, META_FILE, prefixes)
    info.py        one checkpoint's record: CheckpointInfo, read_info, foreign_config
    validation.py  Validation/Validator, checkpoint.json as committed (committed_meta),
                   the files against their sha256 (verify)
    local.py       a run's checkpoints in a directory: committed, find_resume, refusals,
                   retention (retained_steps, prune), remove_checkpoint, clean_staging,
                   LocalCatalog
    store.py       the catalog and protocol of a run in object storage (CheckpointStore)
"""

from __future__ import annotations

from typing import Any

from trainlab.run.checkpoints.info import (
    FORMAT,
    CheckpointInfo,
    data_state,
    foreign_config,
    read_info,
    read_info_at,
)
from trainlab.run.checkpoints.local import (
    LocalCatalog,
    best,
    clean_staging,
    committed,
    find_resume,
    prune,
    refusals,
    remove_checkpoint,
    retained_steps,
)
from trainlab.run.checkpoints.names import (
    DONE_PREFIX,
    FORMAT_VERSION,
    META_FILE,
    PREFIX,
    PULL_PREFIX,
    STAGING_PREFIX,
    TRASH_PREFIX,
    dir_name,
    parse_step,
)
from trainlab.run.checkpoints.validation import Validation, Validator, committed_meta, verify


def catalog(loc: Any) -> Any:
    """The checkpoints of the run at `loc` (a `trainlab.run.location.RunLocation`): a
    `LocalCatalog`, or a `store.CheckpointStore` for a run in object storage."""
    if loc.remote:
        from trainlab.run.checkpoints.store import CheckpointStore

        return CheckpointStore(loc)
    return LocalCatalog(loc.local / "checkpoints")


__all__ = [
    "DONE_PREFIX",
    "FORMAT",
    "FORMAT_VERSION",
    "META_FILE",
    "PREFIX",
    "PULL_PREFIX",
    "STAGING_PREFIX",
    "TRASH_PREFIX",
    "CheckpointInfo",
    "LocalCatalog",
    "Validation",
    "Validator",
    "best",
    "catalog",
    "clean_staging",
    "committed",
    "committed_meta",
    "data_state",
    "dir_name",
    "find_resume",
    "foreign_config",
    "parse_step",
    "prune",
    "read_info",
    "read_info_at",
    "refusals",
    "remove_checkpoint",
    "retained_steps",
    "verify",
]
