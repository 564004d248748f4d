"""Schemes are known in one place (trainlab.location): the rest of the library
holds a Location and calls its operations. What still decides "this machine's
disk or an object store?" outside that package is counted here, like the import
graph's cycles: a new decision is a deliberate change of this number, and the
number only goes down.

What is counted: a test of `.remote` (a run in a store: its working copy,
shipped logs, staged checkpoints) or `.is_local`, a `://` test on a string, a
pyarrow filesystem class named outside the location package. What remains, and
why each is a choice of protocol rather than of an operation, is listed in
docs/layers.md ("From `train.runs_root` to a checkpoint write").
"""

from __future__ import annotations

import re

from tests.conftest import REPO

SOURCE = REPO / "platform" / "trainlab"
DECISION = re.compile(
    r"\.remote\b(?!\()|\.is_local\b|\"://\" in|is_uri\(|scheme_of\(|startswith\(\(?\"(?:s3|gs|file)"
    r"|LocalFileSystem|S3FileSystem|GcsFileSystem"
)
# 39 when the location package landed (the walk from `train.runs_root` to a
# checkpoint write is in docs/layers.md); 38 since a trainer restores through one
# catalog for a directory and an object store; 37 since the log shipper, not its
# two callers, knows that a run on a disk has its logs in place; 34 with one
# freshness rule for a run summary, Location.resolved and Location.file_here;
# 33 with Location.remove_if_empty for a refused run; 30 with one choice of a runs
# root's directory on this node (RunLocation's), the log shipper alone deciding
# to ship, and `track flush` asking whether the run exists wherever it is; 29
# with Ray Train's storage given through the run's own filesystem on a disk too;
# 21 with a location's forms checked, anchored and placed below a folder by
# trainlab.location (config rules, scratch_dir, anchoring, runs root, the job's
# excludes), its folder on this node (`Location.folder_here`), and a dataset
# found and probed through one path for a disk and a store; 16 with the room a
# disk has and holds (`free_bytes`, `reserve`), how often a file is polled, and a
# run's file fetched into its folder here and shipped back as location operations;
# 10 with a probe of every runs root where its writes go (`check_writable` makes
# no folder), one reading of a CONFIG-or-run argument (trainlab.run.dir.
# config_or_run) and config validation asking only what is known offline; 8 with
# a source folder's files listed by its location (`files_below`) and one export
# path for a run or a checkpoint on a disk or in a store (the run's catalog); 6
# with the lease a location operation (trainlab.location.lease: a flock and its
# record on a disk, the record as the lease in a store), one RunLock for both.
MOST = 6


def decisions() -> list[str]:
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        rel = path.relative_to(SOURCE).as_posix()
        if rel.startswith("location/"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if DECISION.search(code) and "ray.remote" not in code:
                found.append(f"{rel}:{n}: {line.strip()}")
    return found


def test_local_or_store_is_decided_in_few_places():
    found = decisions()
    assert len(found) <= MOST, "\n".join(found)


def test_no_second_scheme_parser():
    """Nothing but trainlab.location splits a URI into scheme and bucket."""
    offenders = [
        f"{p.relative_to(SOURCE)}"
        for p in SOURCE.rglob("*.py")
        if not p.relative_to(SOURCE).as_posix().startswith("location/")
        and re.search(r"def is_uri|def _split_uri|FileSystem\.from_uri", p.read_text())
    ]
    assert offenders == []
