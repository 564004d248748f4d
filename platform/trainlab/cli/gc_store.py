"""`trainlab gc --runs-root s3://bucket/prefix`: the same rules as on a disk
(trainlab.cli.gc_cmd), for runs that live in object storage (docs/storage.md).

A run is `{root}/{YYYY-MM-DD}/{name}/` holding config.yaml. Its age is that of
its newest object; a run whose lease (`.lock.json`, trainlab.run.lock
.StoreRunLock) names a live holder is never touched, and the lease is read
again right before anything of a run is deleted. A trimmed run keeps its
records (config.yaml, plan.json, run_summary.json, logs/, the lease) and its
last valid and best checkpoints; `--force` deletes the run whole. A checkpoint
is deleted commit marker first (trainlab.run.checkpoints.store), so a
half-deleted one is never taken for a checkpoint.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from trainlab.run import checkpoints as ckpts
from trainlab.run import holder as run_holder
from trainlab.run import lock as run_lock
from trainlab.run.checkpoints.store import CheckpointStore
from trainlab.run.location import RunLocation

_DATE = re.compile(r"^\d{4}-\d\d-\d\d$")
RECORDS = ("config.yaml", "plan.json", "run_summary.json", "logs", run_lock.HOLDER)


@dataclass
class StoreRun:
    loc: RunLocation
    status: str
    smoke: bool
    age_s: float
    objects: dict[str, int]  # path below the run -> bytes
    live: str | None = None

    @property
    def statuses(self) -> set[str]:
        return {self.status, *(["smoke"] if self.smoke else [])}


@dataclass
class StoreAction:
    run: StoreRun
    whole: bool
    remove: list[str] = field(default_factory=list)  # paths below the run
    kept: dict[str, str] = field(default_factory=dict)
    freed_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "run_dir": self.run.loc.uri,
            "status": self.run.status,
            "smoke": self.run.smoke,
            "age_days": round(self.run.age_s / 86400, 2),
            "action": "delete" if self.whole else "trim",
            "removed": [self.run.loc.uri_of(p) for p in self.remove],
            "kept_checkpoints": self.kept,
            "freed_bytes": self.freed_bytes,
        }


def live_reason(holder: str) -> str:
    return f"live ({holder})"


def _holder(loc: RunLocation) -> str | None:
    holder = run_holder.parse_holder(loc.read_text(run_holder.HOLDER))
    return holder.describe() if holder is not None and run_lock._alive(holder) else None


def _objects(loc: RunLocation) -> tuple[dict[str, int], float]:
    """Every object below the run (path -> bytes) and the newest one's time."""
    from pyarrow import fs

    base = loc.key("").rstrip("/")
    infos = loc.home.filesystem.get_file_info(fs.FileSelector(base, recursive=True))
    files = [i for i in infos if i.type == fs.FileType.File]
    newest = max((i.mtime.timestamp() for i in files if i.mtime), default=0.0)
    return {i.path[len(base) + 1 :]: int(i.size or 0) for i in files}, newest


def find_store_runs(root: str, now: float | None = None) -> list[StoreRun]:
    from trainlab.run.records import RunRecords

    now = time.time() if now is None else now
    top = RunLocation.of(root)
    out = []
    for day in top.list(""):
        if not _DATE.match(day):
            continue
        for name in top.list(day):
            loc = RunLocation.of(f"{top.uri}/{day}/{name}")
            if not loc.exists("config.yaml"):
                continue
            live = _holder(loc)
            objects, newest = ({}, now) if live else _objects(loc)
            summary = RunRecords(loc).read_summary() or {}
            status = str(summary.get("status") or "unfinished")
            smoke = "smoke" in summary or name.endswith("-smoke")
            out.append(StoreRun(loc, status, smoke, max(0.0, now - newest), objects, live))
    return out


def _kept(run: StoreRun) -> dict[str, str]:
    infos = CheckpointStore(run.loc).committed()
    valid = [i for i in infos if i.valid]
    kept: dict[str, str] = {}
    best = ckpts.best(infos)
    if best is not None:
        kept[ckpts.dir_name(best.step)] = "best"
    if valid:
        last = ckpts.dir_name(valid[-1].step)
        kept[last] = "last valid and best" if kept.get(last) == "best" else "last valid"
    return kept


def decide(run: StoreRun, force: bool) -> StoreAction:
    kept = {} if force else _kept(run)
    total = sum(run.objects.values())
    if not kept:
        return StoreAction(run, whole=True, remove=[""], freed_bytes=total)
    remove: dict[str, int] = {}
    for path, size in run.objects.items():
        top = path.split("/", 1)[0]
        if top in RECORDS:
            continue
        if top == "checkpoints":
            step_dir = path.split("/")[1] if "/" in path else path
            if step_dir in kept:
                continue
            key = f"checkpoints/{step_dir}"
        else:
            key = top
        remove[key] = remove.get(key, 0) + size
    return StoreAction(run, False, sorted(remove), kept, sum(remove.values()))


def plan_store_gc(
    root: str, older_than_s: float, statuses: set[str], force: bool
) -> tuple[list[StoreAction], list[tuple[StoreRun, str]]]:
    runs = find_store_runs(root)
    skipped = [(r, live_reason(r.live)) for r in runs if r.live is not None]
    chosen = [
        r for r in runs if r.live is None and r.age_s >= older_than_s and r.statuses & statuses
    ]
    actions = [a for a in (decide(r, force) for r in chosen) if a.whole or a.remove]
    return actions, skipped


def apply_store(actions: list[StoreAction]) -> list[tuple[StoreRun, str]]:
    """Delete what each action says; a run whose lease came alive is left alone."""
    skipped = []
    for action in actions:
        loc = action.run.loc
        live = _holder(loc)
        if live is not None:
            skipped.append((action.run, live_reason(live)))
            continue
        store = CheckpointStore(loc)
        for rel in action.remove:
            step = (
                ckpts.parse_step(rel.rsplit("/", 1)[-1]) if rel.startswith("checkpoints/") else None
            )
            if step is not None:
                store.delete(step)  # commit marker first
            elif rel == "":
                for s in store.step_dirs():
                    store.delete(s)
                loc.home.delete_tree()
            elif rel in action.run.objects:
                loc.home.delete(rel)
            else:
                loc.home.delete_tree(rel)
    return skipped


def gc_store(
    root: str, older_than_s: float, statuses: set[str], dry_run: bool, force: bool
) -> dict[str, Any]:
    """What `trainlab gc --json` prints, for a runs root in object storage."""
    actions, skipped = plan_store_gc(root, older_than_s, statuses, force)
    if not dry_run:
        late = apply_store(actions)
        skipped += late
        gone = {id(r) for r, _ in late}
        actions = [a for a in actions if id(a.run) not in gone]
    return {
        "runs_root": RunLocation.of(root).uri,
        "dry_run": dry_run,
        "force": force,
        "runs": [a.to_json() for a in actions],
        "skipped": [{"run": r.loc.uri, "reason": why} for r, why in skipped],
        "freed_bytes": sum(a.freed_bytes for a in actions),
    }
