"""Run directories: `{runs_root}/{YYYY-MM-DD}/{name}/`, absolute.

How a run directory is chosen (`trainlab train`, `trainers/pretrain.py`):

- default: a new directory for today; if `{name}` is taken, `{name}-2`, `{name}-3`, ...
  (a finished run is never overwritten or silently continued);
- `--run-dir DIR`: exactly DIR. When it already holds checkpoints of the same
  config, training resumes from the newest valid one. This is what a job retry
  passes (`trainlab submit`), so a resubmitted job continues its own run;
- `--resume`: the most recent existing run directory of this config's name
  under runs_root (any date), resumed from its newest valid checkpoint.

A directory whose config.yaml has a different config hash is refused: resuming
it would mix two experiments in one record.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import yaml

from trainlab.config import ExperimentConfig, config_hash, to_yaml
from trainlab.errors import UserError


def runs_root(cfg: ExperimentConfig, base_dir: Path | None = None) -> Path:
    root = Path(cfg.train.runs_root).expanduser()
    if not root.is_absolute():
        root = (base_dir or Path.cwd()) / root
    return root.resolve()


def new_run_dir(
    cfg: ExperimentConfig, base_dir: Path | None = None, today: dt.date | None = None
) -> Path:
    day = runs_root(cfg, base_dir) / (today or dt.date.today()).isoformat()
    candidate, n = day / cfg.name, 1
    while candidate.exists():
        n += 1
        candidate = day / f"{cfg.name}-{n}"
    return candidate


def latest_run_dir(cfg: ExperimentConfig, base_dir: Path | None = None) -> Path:
    """The most recently modified run directory named `{name}` or `{name}-N`."""
    root = runs_root(cfg, base_dir)
    candidates = [
        p for p in root.glob(f"*/{cfg.name}*") if p.is_dir() and _is_run_of(p.name, cfg.name)
    ]
    if not candidates:
        raise UserError(f"--resume: no earlier run named {cfg.name!r} under {root}")
    return max(
        candidates,
        key=lambda p: (
            (p / "config.yaml").stat().st_mtime
            if (p / "config.yaml").exists()
            else p.stat().st_mtime
        ),
    )


def _is_run_of(dirname: str, name: str) -> bool:
    if dirname == name:
        return True
    suffix = dirname.removeprefix(name + "-")
    return suffix != dirname and suffix.isdigit()


def choose_run_dir(
    cfg: ExperimentConfig,
    run_dir: str | Path | None = None,
    resume: bool = False,
    base_dir: Path | None = None,
) -> Path:
    if run_dir is not None:
        path = Path(run_dir).expanduser()
        return (path if path.is_absolute() else (base_dir or Path.cwd()) / path).resolve()
    if resume:
        return latest_run_dir(cfg, base_dir)
    return new_run_dir(cfg, base_dir)


def check_same_experiment(run_dir: Path, cfg: ExperimentConfig) -> None:
    """Refuse to continue a run directory that holds a different experiment."""
    existing = run_dir / "config.yaml"
    if not existing.exists():
        return
    try:
        old = ExperimentConfig.model_validate(yaml.safe_load(existing.read_text()))
    except Exception as e:  # noqa: BLE001 - an unreadable record is the user's to fix
        raise UserError(
            f"{existing}: cannot read the run's config ({e}); choose another --run-dir"
        ) from None
    if config_hash(old) != config_hash(cfg):
        raise UserError(
            f"{run_dir}: holds a different experiment (config hash "
            f"{config_hash(old)} != {config_hash(cfg)}); choose another --run-dir, "
            "or run without --run-dir/--resume to start a new run"
        )


def write_run_files(run_dir: Path, cfg: ExperimentConfig, plan_json: dict[str, Any]) -> None:
    """config.yaml (resolved), plan.json, logs/ and checkpoints/."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    (run_dir / "plan.json").write_text(json.dumps(plan_json, indent=2) + "\n")
