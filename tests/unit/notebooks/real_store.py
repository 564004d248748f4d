"""A small real store for the notebooks (and the export's MLflow record): the
small real prepared dataset (devtools.datasets, shared with the data and
training tests) and a short real training run in process, with the default
callbacks writing its MLflow record into `{runs_root}/mlflow.db`. Built once
per pytest session under the base temp dir; any test module may call it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

from tests.train_helpers import dataset_dir, local_loader, make_job, tiny_config
from trainlab.config.loader import to_yaml

RUN_NAME = "nbrun"
SECTIONS = {
    "name": RUN_NAME,
    "train": {"total_steps": 8, "eval_interval": 4, "checkpoint": {"every_steps": 4}},
    "tracking": {"system_metrics": False, "experiment": "notebooks"},
}


@dataclass(frozen=True)
class RealStore:
    dataset: Path  # a prepared dataset (contract 2)
    runs_root: Path  # holds mlflow.db and the run directory
    run_dir: Path  # {runs_root}/{date}/{name}: config.yaml, checkpoints/, run_summary.json


def real_store(tmp_path_factory: pytest.TempPathFactory) -> RealStore:
    from trainlab.track import default_callbacks
    from trainlab.train.loop.callbacks import CallbackList
    from trainlab.train.loop.trainer import Trainer
    from trainlab.train.parallel.distributed import DistEnv

    dataset = dataset_dir(tmp_path_factory)
    base = tmp_path_factory.getbasetemp() / "real-store"
    runs_root = base / "runs"
    run_dir = runs_root / "2026-01-02" / RUN_NAME
    store = RealStore(dataset, runs_root, run_dir)
    base.mkdir(exist_ok=True)
    with FileLock(str(base / ".lock")):
        if (base / "done").exists():
            return store
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg = tiny_config(
            dataset, **{**SECTIONS, "train": {**SECTIONS["train"], "runs_root": str(runs_root)}}
        )
        job = make_job(cfg, run_dir)
        (run_dir / "config.yaml").write_text(to_yaml(job.cfg))
        callbacks = CallbackList(default_callbacks(job.cfg, runs_root=str(runs_root)))
        summary = Trainer(job, local_loader(job), DistEnv(), callbacks).fit()
        assert summary["status"] == "completed", summary
        (base / "done").touch()
    return store
