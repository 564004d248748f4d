"""A Ray Tune mix search: each trial is an ordinary trainlab run with its own
record, and the search ranks them by validation loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.train_helpers import dataset_dir, tiny_config
from trainlab.config import to_yaml
from trainlab.tune import parse_search, run_search

# Tune trials as trainlab runs are also covered by tests/ray/test_mix.py (make test).
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.extended]


def test_grid_over_mix_weights_runs_one_recorded_run_per_trial(ray_cluster, tmp_path_factory,
                                                               tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = tiny_config(dataset_dir(tmp_path_factory), train={
        "total_steps": 4, "eval_interval": 2, "deterministic": False, "log_interval": 1,
        "checkpoint": {"every_steps": 2, "keep_last": 1}, "runs_root": "runs"},
        tracking={"experiment": "mixsearch", "system_metrics": False})
    config = tmp_path / "mix.yaml"
    config.write_text(to_yaml(cfg))

    result = run_search(str(config), (), parse_search(["data.mix.code=0.2,0.8"]), samples=1,
                        metric="val_loss", max_concurrent=1, seed=0)

    trials = result["trials"]
    assert sorted(t["mix"]["code"] for t in trials) == [0.2, 0.8]
    assert all(t["status"] == "completed" for t in trials), trials
    objectives = [t["objective"] for t in trials]
    assert all(math.isfinite(o) for o in objectives) and objectives == sorted(objectives)
    assert result["best"] == trials[0]
    for t in trials:
        summary = json.loads((Path(t["run_dir"]) / "run_summary.json").read_text())
        assert summary["val_loss"] == pytest.approx(t["objective"])
        # Relative paths were resolved before Tune moved trials into their own directories.
        assert Path(t["run_dir"]).is_relative_to(tmp_path / "runs")

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("mixsearch")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(float(r.data.params["data.mix.code"]) for r in runs) == [0.2, 0.8]
