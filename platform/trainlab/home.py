"""Where trainlab keeps its local state on this machine: `$TRAINLAB_HOME`, else
`~/.trainlab` (the local Ray cluster's state and logs, the tracking server's
folder and state, caches)."""

from __future__ import annotations

import os
from pathlib import Path


def home_dir() -> Path:
    """`$TRAINLAB_HOME` or `~/.trainlab`."""
    return Path(os.environ.get("TRAINLAB_HOME") or Path.home() / ".trainlab").expanduser()


def cache_dir() -> Path:
    """`{home}/cache`: files trainlab can always rebuild (deleting it loses nothing)."""
    return home_dir() / "cache"
