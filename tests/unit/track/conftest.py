"""Fixtures for the tracking, monitoring and comparison tests: a real MLflow
SQLite store per test (copied from one initialised once per session, since
creating the schema takes seconds) and a driver that plays a training run's
rank 0 through the real callbacks."""

from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from trainlab.config import config_hash, load_config
from trainlab.plan import plan
from trainlab.track import default_callbacks
from trainlab.train.loop.callbacks import CallbackList, RunContext

RECIPES = Path(__file__).resolve().parents[3] / "trainers" / "recipes"
# Pinned here so the tests do not move when the tiny recipe is retuned.
RUN_SHAPE = (
    "train.total_steps=60",
    "train.warmup_steps=5",
    "train.log_interval=5",
    "train.eval_interval=20",
    "train.checkpoint.every_steps=20",
)


@pytest.fixture(scope="session")
def _template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()  # creates the schema
    return db


@pytest.fixture
def runs_root(tmp_path: Path, _template_db: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty runs root with an initialised embedded store; MLFLOW_TRACKING_URI unset."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "runs"
    root.mkdir()
    shutil.copy(_template_db, root / "mlflow.db")
    return root


def tiny_config(runs_root: Path, *overrides: str) -> Any:
    return load_config(
        RECIPES / "tiny.yaml",
        [f"train.runs_root={runs_root}", "tracking.system_metrics=false", *RUN_SHAPE, *overrides],
    )


class FakeRank0:
    """Plays the training loop's rank 0: builds the RunContext of a run directory
    and calls the real default callbacks with the loop's metric keys."""

    def __init__(self, cfg: Any, runs_root: Path, date: str = "2026-01-02"):
        self.cfg = cfg
        self.run_dir = runs_root / date / cfg.name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.manifest = self.run_dir.parent / f"{cfg.name}-manifest.json"
        self.manifest.write_text(json.dumps({"format_version": 1, "fingerprint": "f00d"}))
        self.callbacks: CallbackList | None = None

    def context(self, start_step: int = 0, restarts: int = 0, **kw: Any) -> RunContext:
        return RunContext(
            cfg=self.cfg,
            plan=plan(self.cfg).to_json(),
            run_dir=str(self.run_dir),
            config_hash=config_hash(self.cfg),
            dataset_fingerprint="f00d",
            manifest_path=str(self.manifest),
            start_step=start_step,
            restarts=restarts,
            **kw,
        )

    def start(
        self, start_step: int = 0, restarts: int = 0, in_place: bool = False, **kw: Any
    ) -> CallbackList:
        """A fresh process's callbacks (as after a worker-group restart), or with
        `in_place` the same callbacks started again (the agent survives restarts
        of its training process, trainlab.train.supervision.agent)."""
        if not (in_place and self.callbacks is not None):
            if self.callbacks is not None:  # the old process "dies" once its writes landed
                self.callbacks.callbacks[0].flush()
            self.callbacks = CallbackList(default_callbacks(self.cfg))
        self.callbacks.on_run_start(self.context(start_step, restarts, **kw))
        return self.callbacks

    def steps(
        self,
        first: int,
        last: int,
        loss: Callable[[int], float] = lambda s: 9 * math.exp(-s / 40) + 1,
        seed: int = 0,
    ) -> dict[int, dict[str, float]]:
        """Log steps first..last every train.log_interval (evals and checkpoints on
        their intervals); returns what was sent per step."""
        assert self.callbacks is not None
        rng = random.Random(seed)
        t = self.cfg.train
        sent = {}
        for step in range(first, last + 1):
            if step % t.log_interval and step != t.total_steps:
                continue
            metrics = {
                "loss": loss(step) + rng.uniform(-0.05, 0.05),
                "lr": 1e-3,
                "grad_norm": 1 + rng.random(),
                "tokens_per_s": 5000 + rng.uniform(-200, 200),
                "step_time_s": 0.1,
                "data_wait_frac": 0.01,
                "mem_gb": 1.0,
                "mem_peak_gb": 1.1 + step / 1000,
                "share/code": 0.5,
                "share/docs": 0.3,
                "share/pkgdocs": 0.2,
            }
            self.callbacks.on_step_end(step, metrics)
            sent[step] = metrics
            if step % t.eval_interval == 0:
                self.callbacks.on_eval(
                    step,
                    {"code": loss(step) + 0.2, "docs": loss(step) + 0.4, "all": loss(step) + 0.3},
                )
            if step % t.checkpoint.every_steps == 0:
                self.callbacks.on_checkpoint(
                    step, str(self.run_dir / f"checkpoints/step-{step:08d}"), True, loss(step) + 0.3
                )
        return sent

    def end(self, status: str = "completed", **extra: Any) -> None:
        assert self.callbacks is not None
        self.callbacks.on_run_end({"name": self.cfg.name, "status": status, **extra})

    def full_run(self) -> None:
        self.start()
        self.steps(1, self.cfg.train.total_steps)
        self.end()


@pytest.fixture
def rank0(runs_root: Path) -> Callable[..., FakeRank0]:
    """`rank0(*overrides)` -> a FakeRank0 for the tiny recipe with those --set overrides."""

    def make(*overrides: str) -> FakeRank0:
        return FakeRank0(tiny_config(runs_root, *overrides), runs_root)

    return make


@pytest.fixture
def client(runs_root: Path) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{runs_root / 'mlflow.db'}")


def only_run(client: Any) -> Any:
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


def artifact_text(client: Any, run_id: str, path: str) -> str:
    return Path(client.download_artifacts(run_id, path)).read_text()
