"""`trainlab gc [--older-than 14d] [--status failed,smoke] [--dry-run] [--force]`:
free the disk that old runs hold.

It works on the runs root layout (`{runs_root}/{YYYY-MM-DD}/{name}/`,
trainlab.run.dir) and reads each run with the training layer's own readers:
its status from `run_summary.json` (trainlab.run.records; no summary means
"unfinished"), its checkpoints from `checkpoints/` (trainlab.run.checkpoints).

A run is selected when nothing in it changed for `--older-than` (default 14
days: a running run writes its logs and progress all the time) and its status
is one of `--status` (default: all of completed, stopped, failed, unfinished,
smoke; `smoke` = a `--smoke` rehearsal, whatever its outcome). For a selected
run, gc deletes everything except the run's records (config.yaml, plan.json,
run_summary.json, logs/) and two checkpoints: the last valid one (the newest
whose validation passed) and the best one (lowest validation loss); a run that
has neither is deleted whole. `--force` deletes selected runs whole, those two
checkpoints included. `--dry-run` says what would go and deletes nothing. The
MLflow records are never touched (they are small and say what the run was).

A live run is never touched, whatever its age, status or `--force`: one whose
lock (trainlab.run.lock) a live process holds, or whose lock record names
another host with a fresh beat. gc says which runs it skipped and why, and
holds each run's lock while it deletes from it, so a run that starts meanwhile
is skipped too (or refused, if it starts while gc holds the lock).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from trainlab.cli.common import (
    default_runs_root,
    echo_json,
    json_option,
    runs_root_hint,
    runs_root_option,
)
from trainlab.errors import UserError
from trainlab.run import lock as run_lock
from trainlab.runstatus import RunStatus

# How runs ended (trainlab.runstatus), and gc's own two: a run without a summary,
# and a --smoke rehearsal.
STATUSES = (*RunStatus, "unfinished", "smoke")
# What a trimmed run keeps besides its two checkpoints: the record of what it was.
RECORDS = ("config.yaml", "plan.json", "run_summary.json", "logs")
# The run's lock file stays while the directory does (trainlab.run.lock says why).
KEPT_FILES = (*RECORDS, run_lock.LOCK)
_DATE_DIR = re.compile(r"^\d{4}-\d\d-\d\d$")
_UNITS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """'14d', '12h', '30m', '2w' (or a bare number of days) in seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([mhdw]?)\s*", text)
    if not m:
        raise UserError(f"--older-than {text!r}: expected a duration like 14d, 12h, 30m or 2w")
    return float(m.group(1)) * _UNITS[m.group(2) or "d"]


def parse_statuses(text: str | None) -> set[str]:
    if not text:
        return set(STATUSES)
    wanted = {s.strip() for s in text.split(",") if s.strip()}
    unknown = sorted(wanted - set(STATUSES))
    if unknown or not wanted:
        raise UserError(
            f"--status {text!r}: unknown {', '.join(unknown) or 'empty list'}; "
            f"choose from {','.join(STATUSES)}"
        )
    return wanted


# --------------------------------------------------------------------------- reading


@dataclass
class RunInfo:
    path: Path
    status: str  # one of STATUSES but "smoke" (a summary's status, or unfinished)
    smoke: bool
    age_s: float  # since anything in the run directory last changed
    live: str | None = None  # who holds its lock ("pid N on host H since T"), if alive

    @property
    def statuses(self) -> set[str]:
        return {self.status, *(["smoke"] if self.smoke else [])}


def _tree_bytes(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum((Path(d) / f).lstat().st_size for d, _, fs in os.walk(path) for f in fs)


def _newest_mtime(path: Path) -> float:
    newest = path.lstat().st_mtime
    for d, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            newest = max(newest, (Path(d) / name).lstat().st_mtime)
    return newest


def _run_name(path: Path) -> str:
    import yaml

    try:
        raw = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return path.name
    return str(raw.get("name", path.name)) if isinstance(raw, dict) else path.name


def read_run(path: Path, now: float) -> RunInfo:
    from trainlab.run.records import RunRecords

    live = run_lock.live_holder(path)
    if live is not None:  # not walked: a live run's files come and go
        return RunInfo(path, "unfinished", False, 0.0, live)
    summary = RunRecords(path).read_summary() or {}
    status = str(summary.get("status") or "unfinished")
    smoke = "smoke" in summary or _run_name(path).endswith("-smoke")
    return RunInfo(path, status, smoke, max(0.0, now - _newest_mtime(path)))


def find_runs(runs_root: Path, now: float | None = None) -> list[RunInfo]:
    """Every run directory `{runs_root}/{YYYY-MM-DD}/{name}/` holding a config.yaml
    (symlinks are never followed), oldest date first."""
    now = time.time() if now is None else now
    out = []
    if not runs_root.is_dir():
        return out
    for day in sorted(runs_root.iterdir()):
        if not _DATE_DIR.match(day.name) or day.is_symlink() or not day.is_dir():
            continue
        for run in sorted(day.iterdir()):
            if run.is_dir() and not run.is_symlink() and (run / "config.yaml").is_file():
                out.append(read_run(run, now))
    return out


# --------------------------------------------------------------------------- deciding


@dataclass
class Skipped:
    """A run gc left alone, and why."""

    run: RunInfo
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"run": str(self.run.path), "reason": self.reason}


@dataclass
class Action:
    run: RunInfo
    whole: bool  # delete the run directory itself
    remove: list[Path] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # checkpoint dir name -> why
    freed_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run.path),
            "status": self.run.status,
            "smoke": self.run.smoke,
            "age_days": round(self.run.age_s / 86400, 2),
            "action": "delete" if self.whole else "trim",
            "removed": [str(p) for p in self.remove],
            "kept_checkpoints": self.kept,
            "freed_bytes": self.freed_bytes,
        }


def kept_checkpoints(run_dir: Path) -> dict[str, str]:
    """The checkpoints gc keeps without --force: the last valid (newest whose
    validation passed) and the best (lowest validation loss), by directory name."""
    from trainlab.run import checkpoints as ckpts

    infos = ckpts.committed(run_dir / "checkpoints")
    valid = [i for i in infos if i.valid]
    kept: dict[str, str] = {}
    best = ckpts.best(infos)
    if best is not None:
        kept[best.path.name] = "best"
    if valid:
        last = valid[-1].path.name
        kept[last] = "last valid and best" if kept.get(last) == "best" else "last valid"
    return kept


def decide(run: RunInfo, force: bool) -> Action:
    kept = {} if force else kept_checkpoints(run.path)
    if not kept:
        return Action(run, whole=True, remove=[run.path], freed_bytes=_tree_bytes(run.path))
    remove = []
    for child in sorted(run.path.iterdir()):
        if child.name in KEPT_FILES:
            continue
        if child.name == "checkpoints" and child.is_dir() and not child.is_symlink():
            remove += [c for c in sorted(child.iterdir()) if c.name not in kept]
        else:
            remove.append(child)
    freed = sum(_tree_bytes(p) for p in remove)
    return Action(run, whole=False, remove=remove, kept=kept, freed_bytes=freed)


def live_reason(holder: str) -> str:
    return f"live ({holder})"


def plan_gc(
    runs: list[RunInfo], older_than_s: float, statuses: set[str], force: bool
) -> tuple[list[Action], list[Skipped]]:
    """What to delete from which runs, and the live runs left alone."""
    skipped = [Skipped(r, live_reason(r.live)) for r in runs if r.live is not None]
    chosen = [
        r for r in runs if r.live is None and r.age_s >= older_than_s and r.statuses & statuses
    ]
    actions = [a for a in (decide(r, force) for r in chosen) if a.whole or a.remove]
    return actions, skipped


def apply(actions: list[Action]) -> list[Skipped]:
    """Delete what each action says, holding the run's lock meanwhile; a run that
    came alive since it was read is left alone and returned."""
    skipped = []
    for action in actions:
        holder = run_lock.live_holder(action.run.path)  # a holder on another host, too
        with run_lock.held_quietly(action.run.path) as held:
            if holder is not None or not held:
                skipped.append(Skipped(action.run, live_reason(holder or run_lock.UNKNOWN_HOLDER)))
                continue
            for path in action.remove:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
        day = action.run.path.parent
        if action.whole and day.is_dir() and not any(day.iterdir()):
            day.rmdir()
    return skipped


# --------------------------------------------------------------------------- command


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _rel(path: Path, root: Path) -> Path:
    return path.relative_to(root) if path.is_relative_to(root) else path


def _describe(a: Action, root: Path) -> str:
    rel = _rel(a.run.path, root)
    what = ", ".join(sorted(a.run.statuses))
    head = f"{'delete' if a.whole else 'trim'} {rel} ({what}, {a.run.age_s / 86400:.1f} days)"
    if a.whole:
        return f"{head}: {_size(a.freed_bytes)}"
    kept = ", ".join(f"{name} ({why})" for name, why in sorted(a.kept.items()))
    return f"{head}: {len(a.remove)} entries, {_size(a.freed_bytes)}; keeps {kept} and the records"


@click.command()
@runs_root_option("The runs root (train.runs_root) to clean.")
@click.option(
    "--older-than",
    default="14d",
    show_default=True,
    metavar="AGE",
    help="Only runs unchanged for this long (30m, 12h, 14d, 2w).",
)
@click.option(
    "--status",
    "statuses",
    default=None,
    metavar="S[,S...]",
    help=f"Only runs with one of these statuses ({','.join(STATUSES)}; default: all).",
)
@click.option("--dry-run", is_flag=True, help="Say what would be deleted; delete nothing.")
@click.option(
    "--force",
    is_flag=True,
    help="Delete selected runs whole, their last valid and best checkpoints included.",
)
@json_option
def gc(
    runs_root: str | None,
    older_than: str,
    statuses: str | None,
    dry_run: bool,
    force: bool,
    as_json: bool,
) -> int:
    """Delete old run directories and smoke rehearsals, keeping each run's last
    valid and best checkpoint (and its records) unless --force. The runs root may
    be in object storage (s3://bucket/prefix)."""
    from trainlab.location import locate

    age, wanted = parse_age(older_than), parse_statuses(statuses)
    hint, runs_root = runs_root_hint(runs_root), default_runs_root(runs_root)
    if not locate(runs_root, what="--runs-root").is_local:
        return _gc_in_store(runs_root, age, wanted, dry_run, force, as_json)
    root = Path(runs_root).expanduser().resolve()
    if not root.is_dir():
        raise UserError(f"--runs-root {runs_root}: no such directory{hint}")
    actions, skipped = plan_gc(find_runs(root), age, wanted, force)
    if not dry_run:
        late = apply(actions)
        skipped += late
        left_alone = {s.run.path for s in late}
        actions = [a for a in actions if a.run.path not in left_alone]
    freed = sum(a.freed_bytes for a in actions)
    if as_json:
        echo_json(
            {
                "runs_root": str(root),
                "dry_run": dry_run,
                "force": force,
                "runs": [a.to_json() for a in actions],
                "skipped": [s.to_json() for s in skipped],
                "freed_bytes": freed,
            }
        )
        return 0
    for a in actions:
        click.echo(_describe(a, root))
    for s in skipped:
        click.echo(f"skip {_rel(s.run.path, root)}: {s.reason}")
    verb = "would free" if dry_run else "freed"
    click.echo(f"{len(actions)} run(s); {verb} {_size(freed)}" + (" (dry run)" if dry_run else ""))
    return 0


def _gc_in_store(
    root: str, age: float, wanted: set[str], dry_run: bool, force: bool, as_json: bool
) -> int:
    from trainlab.cli.gc_store import gc_store

    try:
        result = gc_store(root, age, wanted, dry_run, force)
    except OSError as e:
        raise UserError(f"--runs-root {root}: cannot read the store: {e}") from None
    if as_json:
        echo_json(result)
        return 0
    base = result["runs_root"].rstrip("/") + "/"
    for a in result["runs"]:
        rel = a["run_dir"].removeprefix(base)
        what = f"{'delete' if a['action'] == 'delete' else 'trim'} {rel} ({a['status']}, "
        what += f"{a['age_days']:.1f} days): {_size(a['freed_bytes'])}"
        if a["kept_checkpoints"]:
            kept = ", ".join(f"{k} ({v})" for k, v in sorted(a["kept_checkpoints"].items()))
            what += f"; keeps {kept} and the records"
        click.echo(what)
    for s in result["skipped"]:
        click.echo(f"skip {s['run'].removeprefix(base)}: {s['reason']}")
    verb = "would free" if dry_run else "freed"
    n, freed = len(result["runs"]), _size(result["freed_bytes"])
    click.echo(f"{n} run(s); {verb} {freed}" + (" (dry run)" if dry_run else ""))
    return 0
