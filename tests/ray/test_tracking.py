"""The experiment record of a real training run on the shared Ray cluster: two
DDP workers, one of them killed mid-run (chaos), resumed from a checkpoint
before the kill. Rank 0 alone writes exactly one MLflow run; the run continues
across the restart with every metric's steps strictly increasing; and
`trainlab compare` shows it. One run serves all the checks (Ray time is dear)."""

from __future__ import annotations

import json

import pytest

from tests.train_helpers import dataset_dir, tiny_config
from trainlab.train import run

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TOTAL_STEPS = 10
KILL_AT = 7


@pytest.fixture(scope="module")
def recorded(ray_cluster, tmp_path_factory):
    """(summary, MlflowClient, runs root) of one chaos-killed 2-worker run."""
    from mlflow import MlflowClient

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.setenv("TRAINLAB_GIT_COMMIT", "c0ffee")
        mp.setenv("TRAINLAB_GIT_DIRTY", "false")
        base = tmp_path_factory.mktemp("tracking")
        cfg = tiny_config(
            dataset_dir(tmp_path_factory),
            name="tracked",
            purpose="check the record",
            resource={"num_workers": 2},
            train={
                "total_steps": TOTAL_STEPS,
                "log_interval": 1,
                "eval_interval": 5,
                "deterministic": False,
                "checkpoint": {"every_steps": 3, "keep_last": 2},
                "chaos": {"kill_at_steps": [KILL_AT], "kill_rank": 1},
            },
            tracking={"experiment": "tracking-ray"},
        )
        summary = run(cfg, base_dir=base)
        yield summary, MlflowClient(f"sqlite:///{base / 'runs' / 'mlflow.db'}"), base / "runs"


def test_rank0_alone_writes_one_run_that_continues_across_the_restart(recorded):
    summary, client, _ = recorded
    assert summary["status"] == "completed" and summary["restarts"] == 1
    assert summary["start_step"] < KILL_AT  # steps after the checkpoint were redone
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1  # not one per worker, not one per attempt
    mlrun = runs[0]
    assert mlrun.info.run_name == "tracked" and mlrun.info.status == "FINISHED"
    tags = mlrun.data.tags
    assert tags["status"] == "completed" and tags["restarts"] == "1"
    assert tags["config_hash"] == summary["config_hash"]
    assert tags["dataset_fingerprint"] == summary["dataset_fingerprint"]
    assert tags["git_commit"] == "c0ffee" and tags["purpose"] == "check the record"
    assert mlrun.data.params["resource.num_workers"] == "2"
    for key in ("loss", "grad_norm", "tokens_per_s", "lr"):
        steps = [m.step for m in client.get_metric_history(mlrun.info.run_id, key)]
        assert steps == list(range(1, TOTAL_STEPS + 1)), key  # strictly increasing, complete
    shares = [k for k in mlrun.data.metrics if k.startswith("share/")]
    assert shares and any(k.startswith("val_loss/") for k in mlrun.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id)}
    assert {
        "config.yaml",
        "plan.json",
        "data",
        "run_summary.json",
        "loss_curve.png",
        "mix_shares.png",
        "alerts.jsonl",
    } <= artifacts


def test_compare_shows_the_run_with_its_results(recorded, capsys, monkeypatch):
    from trainlab.cli import main

    summary, _, runs_root = recorded
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "tracked", "--json", "--runs-root", str(runs_root)])
    assert exit_info.value.code == 0
    (row,) = json.loads(capsys.readouterr().out)["runs"]
    assert row["status"] == "completed" and row["final_step"] == TOTAL_STEPS
    assert row["final_loss"] == pytest.approx(summary["final_loss"])
    assert row["tokens_per_second"] > 0 and row["wall_time_s"] > 0
    assert row["params"]["train.chaos.kill_at_steps"] == [KILL_AT]
