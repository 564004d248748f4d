"""Writing checkpoints: the commit protocol, the async writer, and what ends a save.
Their names, records, validation, catalog and retention (what a reader of a run
needs, without torch) are trainlab.run.checkpoints, whose docstring draws the
layout under `{run_dir}/checkpoints/`.

Protocol, with no collectives off the main thread: every rank writes its files
into the staging directory and then a `.done-rank{r}` marker; rank 0 waits for
all markers, hashes the files, loads the model into a fresh CPU model and runs
one forward on a fixed batch (`validate`), writes checkpoint.json, renames the
directory into place and prunes old checkpoints (keep_last newest valid + the
keep_best valid ones of lowest val_loss). With `async_save` the writing runs in
a background thread while training continues. A run in object storage follows
the store's protocol instead (trainlab.run.checkpoints.store).

The modules, by role (every public name is re-exported here: `ck.commit`, ...):

    disk.py        the commit protocol in a directory: save_file/load_file, done markers,
                   wait_for_ranks, commit
    writer.py      CheckpointWriter: one rank's saves, inline or async, to a directory
                   or to object storage
    faults.py      what ends a save: StorageFault (fault_text, storage_error_in), Orphaned
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
from trainlab.train.checkpoint.writer import CheckpointWriter

__all__ = [
    "FAULT_TEXT",
    "STORAGE_ERRNOS",
    "CheckpointWriter",
    "Orphaned",
    "StorageFault",
    "commit",
    "fault_text",
    "first_line_of",
    "load_file",
    "os_error_in",
    "save_file",
    "storage_error_in",
    "wait_for_ranks",
    "write_done_marker",
]
