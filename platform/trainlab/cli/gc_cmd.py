"""`trainlab gc [--older-than 14d] [--status failed,smoke] [--dry-run] [--force]`:
free the space that old runs hold, on a disk or in object storage (one
implementation: trainlab.location and the run package answer where).

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

import re
import time
from dataclasses import dataclass, field
from typing import Any

import click

from trainlab.cli.common import (
    default_runs_root,
    echo_json,
    json_option,
    runs_root_hint,
    runs_root_option,
)
from trainlab.errors import UserError, first_line
from trainlab.location import Location
from trainlab.run import lock as run_lock
from trainlab.run.location import RunLocation
from trainlab.runstatus import RunStatus

# How runs ended (trainlab.runstatus), and gc's own two: a run without a summary,
# and a --smoke rehearsal.
STATUSES = (*RunStatus, "unfinished", "smoke")
# What a trimmed run keeps besides its two checkpoints: the record of what it was.
RECORDS = ("config.yaml", "plan.json", "run_summary.json", "logs")
# The run's lock file and lease stay while the run does (trainlab.run.lock says why).
KEPT_FILES = (*RECORDS, run_lock.LOCK, run_lock.HOLDER)
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
# One implementation for a runs root on a disk and one in object storage: a run
# is read through its RunLocation (trainlab.run.location), its checkpoints
# through its catalog (trainlab.run.checkpoints.catalog), its liveness through
# trainlab.run.lock.kept_still.


@dataclass
class RunInfo:
    loc: RunLocation
    status: str  # one of STATUSES but "smoke" (a summary's status, or unfinished)
    smoke: bool
    age_s: float  # since its newest file (object) was written
    files: dict[str, int] = field(default_factory=dict)  # below the run -> bytes
    live: str | None = None  # who holds it ("pid N on host H since T"), if alive

    @property
    def statuses(self) -> set[str]:
        return {self.status, *(["smoke"] if self.smoke else [])}

    @property
    def uri(self) -> str:
        return self.loc.uri


def _run_name(loc: RunLocation, default: str) -> str:
    import yaml

    try:
        raw = yaml.safe_load(loc.read_text("config.yaml") or "")
    except (OSError, ValueError, yaml.YAMLError):
        return default
    return str(raw.get("name", default)) if isinstance(raw, dict) else default


def read_run(loc: RunLocation, now: float) -> RunInfo:
    from trainlab.run.records import RunRecords

    with run_lock.kept_still(loc) as live:
        if live is not None:  # not walked: a live run's files come and go
            return RunInfo(loc, "unfinished", False, 0.0, live=live)
    files = loc.home.files()
    newest = max((mtime for _, _, mtime in files), default=now)
    summary = RunRecords(loc).read_summary() or {}
    status = str(summary.get("status") or "unfinished")
    smoke = "smoke" in summary or _run_name(loc, loc.name).endswith("-smoke")
    sizes = {name: size for name, size, _ in files}
    return RunInfo(loc, status, smoke, max(0.0, now - newest), sizes)


def find_runs(root: Location, now: float | None = None) -> list[RunInfo]:
    """Every run `{root}/{YYYY-MM-DD}/{name}/` holding a config.yaml (symbolic
    links are never followed), oldest date first."""
    now = time.time() if now is None else now
    out = []
    for day in root.list():
        if not _DATE_DIR.match(day) or root.is_link(day):
            continue
        for name in root.list(day):
            rel = f"{day}/{name}"
            if not root.is_link(rel) and root.is_file(f"{rel}/config.yaml"):
                out.append(read_run(RunLocation.of(root.child(rel)), now))
    return out


# --------------------------------------------------------------------------- deciding


@dataclass
class Skipped:
    """A run gc left alone, and why."""

    run: RunInfo
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run.uri, "reason": self.reason}


@dataclass
class Action:
    run: RunInfo
    whole: bool  # delete the run itself
    remove: list[str] = field(default_factory=list)  # names below the run
    kept: dict[str, str] = field(default_factory=dict)  # checkpoint dir name -> why
    freed_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "run_dir": self.run.uri,
            "status": self.run.status,
            "smoke": self.run.smoke,
            "age_days": round(self.run.age_s / 86400, 2),
            "action": "delete" if self.whole else "trim",
            "removed": [self.run.loc.uri_of(rel) for rel in self.remove],
            "kept_checkpoints": self.kept,
            "freed_bytes": self.freed_bytes,
        }


def kept_checkpoints(loc: RunLocation) -> dict[str, str]:
    """The checkpoints gc keeps without --force: the last valid (newest whose
    validation passed) and the best (lowest validation loss), by folder name."""
    from trainlab.run import checkpoints as ckpts

    infos = ckpts.catalog(loc).committed()
    valid = [i for i in infos if i.valid]
    kept: dict[str, str] = {}
    best = ckpts.best(infos)
    if best is not None:
        kept[ckpts.dir_name(best.step)] = "best"
    if valid:
        last = ckpts.dir_name(valid[-1].step)
        kept[last] = "last valid and best" if kept.get(last) == "best" else "last valid"
    return kept


def _below(files: dict[str, int], rel: str) -> int:
    return sum(size for name, size in files.items() if name == rel or name.startswith(rel + "/"))


def decide(run: RunInfo, force: bool) -> Action:
    kept = {} if force else kept_checkpoints(run.loc)
    if not kept:
        return Action(run, whole=True, remove=[""], freed_bytes=sum(run.files.values()))
    home, remove = run.loc.home, []
    for name in home.list():
        if name in KEPT_FILES:
            continue
        if name == "checkpoints" and not home.is_link(name) and not home.is_file(name):
            remove += [f"{name}/{c}" for c in home.list(name) if c not in kept]
        else:
            remove.append(name)
    freed = sum(_below(run.files, rel) for rel in remove)
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


def _delete(loc: RunLocation, rel: str) -> None:
    """Delete `rel` below the run ("" the run whole): a checkpoint through its
    catalog (commit marker first: a half-deleted one is never taken for a
    checkpoint), a link as a link (never what it points to)."""
    from trainlab.run import checkpoints as ckpts

    home = loc.home
    if rel == "":
        if not home.is_link("checkpoints"):
            for name in home.list("checkpoints"):
                _delete(loc, f"checkpoints/{name}")
        home.delete_tree()
        return
    step = (
        ckpts.parse_step(rel.removeprefix("checkpoints/"))
        if rel.startswith("checkpoints/")
        else None
    )
    if step is not None and not home.is_link(rel):
        ckpts.catalog(loc).delete(step)
    elif home.is_link(rel) or home.is_file(rel):
        home.delete(rel)
    else:
        home.delete_tree(rel)


def apply(actions: list[Action]) -> list[Skipped]:
    """Delete what each action says, the run kept still meanwhile
    (trainlab.run.lock.kept_still); a run that came alive since it was read is
    left alone and returned."""
    skipped = []
    for action in actions:
        loc = action.run.loc
        with run_lock.kept_still(loc) as live:
            if live is not None:
                skipped.append(Skipped(action.run, live_reason(live)))
                continue
            for rel in action.remove:
                _delete(loc, rel)
        if action.whole:
            loc.home.parent.remove_if_empty()  # the date's folder, once empty
    return skipped


# --------------------------------------------------------------------------- command


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _rel(uri: str, root: Location) -> str:
    return uri.removeprefix(root.uri.rstrip("/") + "/")


def _describe(a: Action, root: Location) -> str:
    what = ", ".join(sorted(a.run.statuses))
    head = f"{'delete' if a.whole else 'trim'} {_rel(a.run.uri, root)} ({what}, "
    head += f"{a.run.age_s / 86400:.1f} days)"
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
    be in object storage (s3://bucket/prefix, gs://bucket/prefix)."""
    from trainlab.location import StorageError, locate

    age, wanted = parse_age(older_than), parse_statuses(statuses)
    hint, runs_root = runs_root_hint(runs_root), default_runs_root(runs_root)
    root = locate(runs_root, what="--runs-root").resolved()
    try:
        if not root.exists():
            raise UserError(f"--runs-root {runs_root}: no such directory or prefix{hint}")
        actions, skipped = plan_gc(find_runs(root), age, wanted, force)
        if not dry_run:
            late = apply(actions)
            skipped += late
            left_alone = {s.run.uri for s in late}
            actions = [a for a in actions if a.run.uri not in left_alone]
    except (StorageError, OSError) as e:
        raise UserError(f"--runs-root {runs_root}: cannot read it: {first_line(e)}") from None
    freed = sum(a.freed_bytes for a in actions)
    if as_json:
        echo_json(
            {
                "runs_root": root.uri,
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
        click.echo(f"skip {_rel(s.run.uri, root)}: {s.reason}")
    verb = "would free" if dry_run else "freed"
    click.echo(f"{len(actions)} run(s); {verb} {_size(freed)}" + (" (dry run)" if dry_run else ""))
    return 0
