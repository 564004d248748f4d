"""The swarm record on disk: `{runs_root}/mix/{swarm_id}/swarm.json`.

One JSON file per swarm holds what fit, propose and confirm need without MLflow:
the configs (resolved, absolute paths), the sources and their training tokens,
the sampling, every trial (mix, status, run directory, held-out losses, wall
time), the cost, and what later commands added (fits, proposals, confirmations).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from trainlab.errors import UserError
from trainlab.fileutil import write_text_atomic

_ID = re.compile(r"^[0-9a-f]{8}$")


def swarm_dir(runs_root: str | Path, swarm_id: str) -> Path:
    return Path(runs_root).resolve() / "mix" / swarm_id


def save(record: dict[str, Any], runs_root: str | Path | None = None) -> Path:
    path = swarm_dir(runs_root or record["runs_root"], record["swarm_id"]) / "swarm.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(record, indent=1, default=str) + "\n")
    return path


def load(swarm_id: str, runs_root: str | Path = "runs") -> dict[str, Any]:
    """The record of `swarm_id`; UserError naming the swarms there are when missing."""
    if not _ID.match(swarm_id):
        raise UserError(f"SWARM_ID {swarm_id!r}: expected 8 hex digits (see {Path(runs_root) / 'mix'})")
    path = swarm_dir(runs_root, swarm_id) / "swarm.json"
    if not path.exists():
        known = sorted(p.parent.name for p in (Path(runs_root) / "mix").glob("*/swarm.json"))
        raise UserError(f"swarm {swarm_id}: no {path} (swarms in {Path(runs_root).resolve()}: "
                        f"{', '.join(known) or 'none'}; --runs-root to look elsewhere)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not a swarm record ({e})") from None
