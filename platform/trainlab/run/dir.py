"""Run directories: `{runs_root}/{YYYY-MM-DD}/{name}/`, absolute.

`train.runs_root` is made absolute when the config is read, against the
config file's repository root (`trainlab.config.loader.config_anchor`); a
config built in code with a relative runs_root is anchored at `base_dir` or
at the checkout holding trainlab, never at the current directory. A run
started with `--set` changes to what is trained is named after them
(`tiny_lr-1e-3`, `loader.override_name`), and keeps the `-2`, `-3` sequence.

How a run directory is chosen (`trainlab train`, `trainers/pretrain.py`):

- default: a new directory for today; if `{name}` is taken, `{name}-2`, `{name}-3`, ...
  (a finished run is never overwritten or silently continued);
- `--run-dir DIR`: exactly DIR. When it already holds checkpoints of the same
  config, training resumes from the newest valid one. A DIR where nothing is
  yet is refused (a mistyped path would start a new run there) unless the user
  asks for a new run there with `--create` (`check_exists`). `trainlab submit`
  passes `--run-dir DIR --create` for a new job's run, so a job retry (the same
  command) continues its own run;
- `--resume`: the most recent existing run directory of this config's name
  under runs_root (any date), resumed from its newest valid checkpoint.

A directory whose config.yaml has a different config hash is refused: resuming
it would mix two experiments in one record. The refusal lists each differing
key of the experiment's identity with both values.

A run whose run_summary.json says it completed its `train.total_steps` is done:
`--resume` / `--run-dir` of it changes nothing (`completed_summary`). Training
it longer is `--extend` with a larger `--set train.total_steps=N`, the only
identity key it may change: the run keeps the config hash it started with (its
checkpoints carry it), config.yaml takes the new length, and
logs/extensions.jsonl records what changed (`check_same_experiment`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from pathlib import Path
from typing import Any

import yaml

from trainlab.config import ExperimentConfig, config_hash, to_yaml
from trainlab.config.loader import identity_diff
from trainlab.errors import UserError
from trainlab.location import Location, locate
from trainlab.run.location import RunLocation
from trainlab.run.records import RunRecords
from trainlab.runstatus import RunStatus

EXTEND_KEY = "train.total_steps"


def _checkout() -> Path | None:
    """The repository holding this package (an editable install), if any."""
    import trainlab

    root = Path(trainlab.__file__).resolve().parents[2]  # {repo}/platform/trainlab/
    return root if (root / "pyproject.toml").is_file() else None


def root_location(cfg: ExperimentConfig, base_dir: Path | None = None) -> Location:
    """The runs root, absolute: a store location as written; a path (symlinks
    resolved) relative to `base_dir` when relative (a config built in code;
    `load_config` anchors those it reads), else to the checkout holding trainlab;
    outside one it is an error, not the current directory."""
    return locate(
        cfg.train.runs_root,
        what="train.runs_root",
        base_dir=base_dir or _checkout(),
        no_anchor="the config has no file to anchor it",
    ).resolved()


def new_run_dir(
    cfg: ExperimentConfig, base_dir: Path | None = None, today: dt.date | None = None
) -> Location:
    """A new run's location for today: `{name}`, else `{name}-2`, `{name}-3`, ..."""
    day = root_location(cfg, base_dir).child((today or dt.date.today()).isoformat())
    candidate, n = day.child(cfg.name), 1
    while candidate.exists():  # a run directory (or store prefix) holding something
        n += 1
        candidate = day.child(f"{cfg.name}-{n}")
    return candidate


def latest_run_dir(cfg: ExperimentConfig, base_dir: Path | None = None) -> Location:
    """The most recent run named `{name}` or `{name}-N` (by its config.yaml's time)."""
    root = root_location(cfg, base_dir)
    found = []
    for day in root.list():
        for name in root.list(day):
            if not _is_run_of(name, cfg.name):
                continue
            run = root.child(f"{day}/{name}")
            # A run is known by its config.yaml; a run folder without one yet (a
            # start that was cut short) by the folder's own time.
            when = run.modified("config.yaml")
            if when is None and run.list():
                when = run.modified()
            if when is not None:
                found.append((when, day, name))
    if not found:
        raise UserError(f"--resume: no earlier run named {cfg.name!r} under {root}")
    _, day, name = max(found)
    return root.child(f"{day}/{name}")


def _is_run_of(dirname: str, name: str) -> bool:
    """`dirname` is run `name` or its `-N`, also as an earlier version named it
    (`tiny_total_steps-20` for `tiny_steps-20`: loader.abbreviated)."""
    from trainlab.config.loader import abbreviated

    return _named(dirname, name) or _named(abbreviated(dirname), name)


def _named(dirname: str, name: str) -> bool:
    if dirname == name:
        return True
    suffix = dirname.removeprefix(name + "-")
    return suffix != dirname and suffix.isdigit()


def choose_run_dir(
    cfg: ExperimentConfig,
    run_dir: str | Path | None = None,
    resume: bool = False,
    base_dir: Path | None = None,
) -> RunLocation:
    """Where the run goes (see the module docstring): a `RunLocation`, whose `uri`
    is the run directory or, for a run in object storage, its URI."""
    scratch = cfg.resource.scratch_dir
    if run_dir is not None:
        where = locate(run_dir, what="--run-dir", base_dir=base_dir).resolved()
        return RunLocation.of(where, scratch)
    if resume:
        return RunLocation.of(latest_run_dir(cfg, base_dir), scratch)
    return RunLocation.of(new_run_dir(cfg, base_dir), scratch)


def check_exists(run_dir: str | Path, base_dir: Path | None = None) -> None:
    """`--run-dir` names a run to continue: a place where nothing is (a path that
    does not exist, an empty store prefix) is refused unless the user asks for a
    new run there (`--create`), since a mistyped path would start one."""
    where = locate(run_dir, what="--run-dir", base_dir=base_dir)
    if not where.exists():
        raise UserError(
            f"--run-dir {where.uri}: no such run directory; to start a new run there add "
            "--create, or leave --run-dir out for a new run under train.runs_root"
        )


# What trainlab itself puts in a run directory before its config.yaml is written
# (the lock, the logs of a start that was refused): such a directory is a run's.
OWN_ENTRIES = frozenset({".lock", ".lock.json", "logs", "checkpoints", "ray"})


def check_usable(loc: RunLocation) -> None:
    """A run directory given by the user (`--run-dir`) must be new, empty, or a
    trainlab run directory; anything else (a folder of the user's files, the
    repository) is refused before anything is written into it."""
    if loc.home.is_file(""):
        raise UserError(f"--run-dir {loc.uri}: a file, not a directory")
    names = loc.list("")
    if not names or "config.yaml" in names or set(names) <= OWN_ENTRIES:
        return
    shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
    raise UserError(
        f"--run-dir {loc.uri}: not a trainlab run directory (no config.yaml; it holds "
        f"{shown}); give a new or empty directory, or a run directory to continue, or "
        "leave --run-dir out for a new run under train.runs_root"
    )


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """What a run directory continues as: the config hash its checkpoints and
    records carry, and the extension to record when `--extend` changes its length."""

    config_hash: str
    extension: dict[str, Any] | None = None


def _as_location(run_dir: Path | str | RunLocation) -> RunLocation:
    return run_dir if isinstance(run_dir, RunLocation) else RunLocation.of(run_dir)


def read_run_config(run_dir: Path | str | RunLocation) -> ExperimentConfig | None:
    """The config.yaml of a run directory (None when it has none yet)."""
    loc = _as_location(run_dir)
    text = loc.read_text("config.yaml")
    if text is None:
        return None
    try:
        return ExperimentConfig.model_validate(yaml.safe_load(text))
    except Exception as e:  # noqa: BLE001 - an unreadable record is the user's to fix
        raise UserError(
            f"{loc.uri_of('config.yaml')}: cannot read the run's config ({e}); "
            "choose another --run-dir"
        ) from None


def check_same_experiment(
    run_dir: Path | RunLocation, cfg: ExperimentConfig, extend: bool = False
) -> RunIdentity:
    """Refuse to continue a run directory that holds a different experiment; with
    `extend`, allow (and describe) a larger train.total_steps and nothing else.
    Reads only."""
    run_dir = _as_location(run_dir)
    old = read_run_config(run_dir)
    if old is None:
        if extend:
            raise UserError(f"--extend: {run_dir.uri} holds no run to extend")
        return RunIdentity(config_hash(cfg))
    run_hash = _run_hash(run_dir, config_hash(old))
    diff = identity_diff(old, cfg)
    if not extend:
        if diff:
            longer = EXTEND_KEY in diff and diff[EXTEND_KEY][1] > diff[EXTEND_KEY][0]
            hint = "; to train the run longer add --extend" if longer else ""
            raise UserError(
                f"{run_dir.uri}: holds a different experiment (config hash {config_hash(old)} "
                f"!= {config_hash(cfg)}; {_describe(diff)}); choose another --run-dir, or "
                f"run without --run-dir/--resume to start a new run{hint}"
            )
        return RunIdentity(run_hash)
    if not diff and run_hash != config_hash(old):
        return RunIdentity(run_hash)  # an earlier --extend already made it this long
    before, after = diff.get(EXTEND_KEY, (old.train.total_steps, old.train.total_steps))
    others = {k: v for k, v in diff.items() if k != EXTEND_KEY}
    if others:
        raise UserError(
            f"--extend: only {EXTEND_KEY} may change, {run_dir.uri} holds a run that also "
            f"differs in {_describe(others)}"
        )
    if after <= before:
        raise UserError(
            f"--extend: give a longer run with --set {EXTEND_KEY}=N, N > {before} "
            f"(the run's {EXTEND_KEY}; this config says {after})"
        )
    extension = {
        "changed": {EXTEND_KEY: [before, after]},
        "at_step": (RunRecords(run_dir).read_summary() or {}).get("final_step"),
        "from_config_hash": config_hash(old),
        "config_hash": config_hash(cfg),
        "run_config_hash": run_hash,
    }
    return RunIdentity(run_hash, extension)


def _run_hash(run_dir: RunLocation, current: str) -> str:
    """The config hash the run started with when config.yaml (hash `current`) is
    the result of its latest --extend, else `current`."""
    extensions = RunRecords(run_dir).extensions()
    if extensions and extensions[-1].get("config_hash") == current:
        return str(extensions[-1].get("run_config_hash") or current)
    return current


def _describe(diff: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k}: {a!r} in the run, {b!r} now" for k, (a, b) in diff.items())


def completed_summary(run_dir: Path | RunLocation, cfg: ExperimentConfig) -> dict[str, Any] | None:
    """run_summary.json of `run_dir` when it says the run completed cfg's
    train.total_steps (nothing is left to do), else None. Reads only."""
    summary = RunRecords(_as_location(run_dir)).read_summary()
    if (
        summary
        and summary.get("status") == RunStatus.COMPLETED
        and summary.get("final_step") == cfg.train.total_steps
    ):
        return summary
    return None


def write_run_files(
    run_dir: Path | RunLocation, cfg: ExperimentConfig, plan_json: dict[str, Any]
) -> None:
    """config.yaml (resolved) and plan.json where the run lives; logs/ and
    checkpoints/ in this node's directory of it."""
    loc = _as_location(run_dir)
    (loc.local / "logs").mkdir(parents=True, exist_ok=True)
    (loc.local / "checkpoints").mkdir(exist_ok=True)
    loc.write_text("config.yaml", to_yaml(cfg))
    loc.write_text("plan.json", json.dumps(plan_json, indent=2) + "\n")


def config_or_run(where: str, what: str) -> tuple[Path, RunLocation | None]:
    """What a command's CONFIG-or-run argument names: a run (a run directory, or a
    run in object storage) holding config.yaml, which is brought into this node's
    folder of the run, or a config file on this machine. Returns (the config file
    here, the run or None); a one-line UserError naming `what` when it is neither."""
    from trainlab.errors import first_line

    run = RunLocation.of(where, what=what)
    try:
        if run.fetch("config.yaml"):
            return run.local / "config.yaml", run
        there = run.home.exists()
        a_file = there and run.home.is_file("")
    except OSError as e:
        raise UserError(f"{what} = {where!r}: cannot read it: {first_line(e)}") from None
    if not there:
        raise UserError(f"{what} = {where!r}: no such file, and no run there (no config.yaml)")
    if not a_file:
        raise UserError(f"{what} = {where!r}: not a run directory (no config.yaml)")
    try:
        return run.home.local_path(), None
    except ValueError:
        raise UserError(
            f"{what} = {where!r}: a file in object storage; give a run there (its folder) "
            "or a config file on this machine"
        ) from None
