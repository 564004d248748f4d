"""A config read inside Ray's uploaded copy of a job's working dir.

`ray job submit --working-dir . -- python trainers/pretrain.py CONFIG` runs the
entry script in a copy of the working dir that Ray unpacked on the cluster
(`.../runtime_resources/working_dir_files/_ray_pkg_<hash>/`). That copy is the
config's repository root, so a relative path in the config would be anchored
there: but Ray leaves git-ignored files out of it (the prepared data under
data/ is not there) and deletes it with the job (a run written under its runs/
would be lost). Nothing in the job says where it was submitted from, so such a
path cannot be resolved against the submitter's checkout: it is refused, in one
line naming the key and the fix. `trainlab submit` makes every path absolute
before it ships the config, so its jobs never meet this.
"""

from __future__ import annotations

from pathlib import Path

RAY_PACKAGE_PREFIX = "_ray_pkg_"
RAY_WORKING_DIRS = "working_dir_files"


def uploaded_copy(anchor: Path) -> Path | None:
    """The Ray job working-dir copy holding `anchor`, or None."""
    for d in (anchor, *anchor.parents):
        if d.name.startswith(RAY_PACKAGE_PREFIX) and d.parent.name == RAY_WORKING_DIRS:
            return d
    return None


def is_relative(value: str) -> bool:
    return "://" not in value and not Path(value).expanduser().is_absolute()


def relative_in_copy(key: str, value: str, copy: Path) -> str:
    """The problem line for a relative `key` in a config inside `copy`."""
    example = "$PWD/data/demo/prepared" if key == "data.path" else "$PWD/runs"
    return (
        f"{key} = {value!r}: a relative path in a job running from Ray's uploaded copy of "
        f"its working dir ({copy}), which lacks git-ignored files (data/) and is deleted "
        f"with the job; give an absolute path every node sees or s3://bucket/prefix "
        f"(ray job submit ... -- python trainers/pretrain.py CONFIG --set {key}={example}), "
        "or use `trainlab submit`, which does that"
    )
