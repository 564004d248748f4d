"""The code version of a run: git commit and whether the tree had local changes.

A job submitted to a cluster runs from a copy of the repo without `.git`, so
the submitting side captures these and passes them on in the environment
(`TRAINLAB_GIT_COMMIT`, `TRAINLAB_GIT_DIRTY`); they win over asking git here.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ENV_COMMIT = "TRAINLAB_GIT_COMMIT"
ENV_DIRTY = "TRAINLAB_GIT_DIRTY"
UNKNOWN = "unknown"

# The library's own checkout (platform/trainlab/track -> repo root), for editable installs.
_PACKAGE_REPO = Path(__file__).resolve().parents[3]


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def git_info(path: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """{"commit": sha or "unknown", "dirty": "true" | "false" | "unknown"}.

    Looks at the environment first, then the git checkout at `path` (default:
    the current directory, then the checkout the library was installed from).
    """
    if os.environ.get(ENV_COMMIT):
        return {
            "commit": os.environ[ENV_COMMIT],
            "dirty": os.environ.get(ENV_DIRTY, UNKNOWN).lower(),
        }
    candidates = [Path(path)] if path is not None else [Path.cwd(), _PACKAGE_REPO]
    for where in candidates:
        commit = _git(["rev-parse", "HEAD"], where)
        if commit is None:
            continue
        status = _git(["status", "--porcelain", "--untracked-files=no"], where)
        dirty = UNKNOWN if status is None else str(bool(status.strip())).lower()
        return {"commit": commit.strip(), "dirty": dirty}
    return {"commit": UNKNOWN, "dirty": UNKNOWN}


def git_env(path: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Environment variables that carry this checkout's version into a job."""
    info = git_info(path)
    return {ENV_COMMIT: info["commit"], ENV_DIRTY: info["dirty"]}
