"""An MoE run through `trainlab.train.run` on the shared local Ray cluster: 2 Ray
Train workers with expert parallelism (ep=2, each holding 2 of the 4 experts,
tokens by all-to-all over gloo) and bias balancing, a worker killed after the
step-2 checkpoint. The run restarts from it and ends on the curve of the same
config at ep=1 trained by the same Trainer on 2 local gloo processes (unit tests
cover the layouts one by one: tests/unit/train/test_expert_parallel.py); the
router's health reaches MLflow per layer, and the plan counts active parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train_helpers import dataset_dir, make_job
from tests.unit.train.layout_runner import run_layout
from tests.unit.train.test_expert_parallel import RTOL, STEPS, ep_config
from trainlab.train import run

pytestmark = [pytest.mark.ray, pytest.mark.slow]

KILL_AT = 3  # after the step-2 checkpoint; steps 3-4 are trained again


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def test_an_expert_parallel_run_on_ray_restarts_and_trains_as_ep1(
    ray_cluster, dataset, tmp_path, monkeypatch
):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reference, _ = run_layout(
        make_job(ep_config(dataset, 1), tmp_path / "ep1"), 2, tmp_path / "ep1.json"
    )
    cfg = ep_config(dataset, 2)
    t = cfg.train
    chaos = t.chaos.model_copy(update={"kill_at_steps": [KILL_AT], "kill_rank": 1})
    cfg = cfg.model_copy(update={"train": t.model_copy(update={"chaos": chaos})})
    summary = run(cfg, base_dir=tmp_path / "ray")

    assert summary["status"] == "completed" and summary["restarts"] == 1, summary
    assert summary["start_step"] == 2 and summary["final_step"] == STEPS
    assert summary["final_loss"] == pytest.approx(reference[STEPS], rel=RTOL)

    client = MlflowClient(f"sqlite:///{tmp_path / 'ray' / 'runs' / 'mlflow.db'}")
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    losses = {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, "loss")}
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in losses.items():  # the killed attempt's and the restart's steps
        assert loss == pytest.approx(reference[step], rel=RTOL), (step, losses, reference)
    metrics = mlrun.data.metrics
    for layer in (0, 1):  # the tiny model's two blocks, both MoE
        for key in ("load_max_over_mean", "dead_frac", "aux_loss", "entropy"):
            assert f"moe_layer{layer}/{key}" in metrics, (layer, key, sorted(metrics))
    assert metrics["moe_layer0/load_max_over_mean"] >= 1.0

    plan = json.loads((Path(summary["run_dir"]) / "plan.json").read_text())
    assert 0 < plan["num_params_active"] < plan["num_params"]  # top 2 of 4 experts
    assert plan["parallel"]["ep"] == 2 and plan["moe"]["experts_params"] > 0
