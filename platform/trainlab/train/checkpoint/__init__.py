"""Checkpoints on disk: atomic commits, validation, retention, resume selection.

Layout under `{run_dir}/checkpoints/`:

    step-00000020/              a committed checkpoint (the rename is the commit)
      checkpoint.json           written last: step, files + sha256, valid, val_loss, ...
      trainer.pt                step, data position, config hash, dataset fingerprint
      rng-rank0.pt ...          RNG of Python, NumPy, torch (CUDA) of every rank
      state/                    torch.distributed.checkpoint (DCP) shards, every layout
    .tmp-step-00000040/         being written; never read, removed on the next start
                                (and at once when its write fails: `StorageFault`)

Protocol, with no collectives off the main thread: every rank writes its files
into the staging directory and then a `.done-rank{r}` marker; rank 0 waits for
all markers, hashes the files, loads the model into a fresh CPU model and runs
one forward on a fixed batch (`validate`), writes checkpoint.json, renames the
directory into place and prunes old checkpoints (keep_last newest valid + the
keep_best valid ones of lowest val_loss). With `async_save` the writing runs in
a background thread while training continues.

Why not Ray Train's own checkpoint registry (`ray.train.report(checkpoint=)`):
its run snapshot refuses to restore once a checkpoint it recorded is deleted by
our retention, and `get_checkpoint()` returns the newest reported checkpoint
whether or not it loads. Resume here picks the newest checkpoint that is marked
valid AND whose files still match their checksums, warning about each one skipped.

The modules, by role (every public name is re-exported here: `ck.commit`, ...):

    names.py       what the files and folders are called (dir_name, META_FILE, prefixes)
    info.py        one checkpoint's record: CheckpointInfo, read_info, foreign_config
    validation.py  Validation/Validator, checkpoint.json as committed (committed_meta),
                   the files against their sha256 (verify)
    local.py       a run's checkpoints in a directory: committed, find_resume, refusals,
                   retention (retained_steps, prune), remove_checkpoint, clean_staging,
                   LocalCatalog; catalog(loc) for any run
    disk.py        the commit protocol in a directory: save_file/load_file, done markers,
                   wait_for_ranks, commit
    writer.py      CheckpointWriter: one rank's saves, inline or async, to a directory
                   or to object storage
    faults.py      what ends a save: StorageFault (fault_text, storage_error_in), Orphaned
    store.py       the catalog and protocol of a run in object storage (CheckpointStore)
"""

from __future__ import annotations

from trainlab.train.checkpoint.disk import (
    commit,
    load_file,
    save_file,
    wait_for_ranks,
    write_done_marker,
)
from trainlab.train.checkpoint.faults import (
    FAULT_TEXT,
    STORAGE_ERRNOS,
    Orphaned,
    StorageFault,
    fault_text,
    first_line_of,
    os_error_in,
    storage_error_in,
)
from trainlab.train.checkpoint.info import (
    FORMAT,
    CheckpointInfo,
    data_state,
    foreign_config,
    read_info,
    read_info_at,
)
from trainlab.train.checkpoint.local import (
    LocalCatalog,
    best,
    catalog,
    clean_staging,
    committed,
    find_resume,
    prune,
    refusals,
    remove_checkpoint,
    retained_steps,
)
from trainlab.train.checkpoint.names import (
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
from trainlab.train.checkpoint.validation import Validation, Validator, committed_meta, verify
from trainlab.train.checkpoint.writer import CheckpointWriter

__all__ = [
    "DONE_PREFIX",
    "FAULT_TEXT",
    "FORMAT",
    "FORMAT_VERSION",
    "META_FILE",
    "PREFIX",
    "PULL_PREFIX",
    "STAGING_PREFIX",
    "STORAGE_ERRNOS",
    "TRASH_PREFIX",
    "CheckpointInfo",
    "CheckpointWriter",
    "LocalCatalog",
    "Orphaned",
    "StorageFault",
    "Validation",
    "Validator",
    "best",
    "catalog",
    "clean_staging",
    "commit",
    "committed",
    "committed_meta",
    "data_state",
    "dir_name",
    "fault_text",
    "find_resume",
    "first_line_of",
    "foreign_config",
    "load_file",
    "os_error_in",
    "parse_step",
    "prune",
    "read_info",
    "read_info_at",
    "refusals",
    "remove_checkpoint",
    "retained_steps",
    "save_file",
    "storage_error_in",
    "verify",
    "wait_for_ranks",
    "write_done_marker",
]
