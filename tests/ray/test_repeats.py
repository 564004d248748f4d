"""Repeats and noise bands on real runs (issue 31): a group of seeds of the tiny
config and a run with another lr, trained on the session's Ray cluster, recorded
in a real MLflow store; each run's summary holds its environment (the node check
passed), the seeds are children of the group's parent run, and compare gives the
group's band and the single run against it. The statistics themselves:
tests/unit/track/test_noise.py."""

from __future__ import annotations

import mlflow
import pytest

from tests.train_helpers import dataset_dir, tiny_config
from trainlab.cli.repeats import run_group
from trainlab.track.backend import tracking_uri
from trainlab.track.noise import LARGER, WITHIN
from trainlab.track.query import compare_report
from trainlab.train import run

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = {"total_steps": 3, "warmup_steps": 1, "log_interval": 1, "eval_interval": 3}


def test_a_group_of_seeds_and_a_changed_run_compared_with_the_noise_band(
    ray_cluster, tmp_path_factory, tmp_path
):
    dataset = dataset_dir(tmp_path_factory)
    runs = tmp_path / "runs"
    cfg = tiny_config(dataset, train={**STEPS, "runs_root": str(runs)})
    group = run_group(cfg, 2, lambda c: run(c, base_dir=tmp_path))
    assert group["status"] == "completed" and len(group["runs"]) == 2
    seeds = [(r["group"]["index"], r["group"]["group_id"]) for r in group["runs"]]
    assert seeds == [(0, group["group_id"]), (1, group["group_id"])]
    env = group["runs"][0]["environment"]
    assert env["torch"] == "2.13.0+cpu" and env["lock"] == "cpu" and env["drift"] == []
    assert env["lock_sha256"] and env["nodes"] >= 1 and env["accelerator"] == "cpu"
    assert group["runs"][0]["val_loss"] != group["runs"][1]["val_loss"]  # other seeds

    other = tiny_config(dataset, train={**STEPS, "runs_root": str(runs), "lr": 3e-2})
    single = run(other, base_dir=tmp_path)

    uri = tracking_uri(runs)
    client = mlflow.MlflowClient(uri)
    parent = client.get_run(group["parent_run_id"])
    assert parent.data.tags["trainlab.kind"] == "group"
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert len(children) == 2
    assert children[0].data.tags["env.torch"] == "2.13.0+cpu"

    report = compare_report(uri, [group["group_id"], single["run_dir"].rsplit("/", 1)[-1]])
    (g,) = report["groups"]
    band = g["metrics"]["val_loss"]
    assert band["n"] == 2 and band["std"] > 0
    (c,) = report["comparisons"]
    val = c["metrics"]["val_loss"]
    assert val["difference"] == pytest.approx(single["val_loss"] - band["mean"])
    lo, hi = val["interval"]
    assert lo < val["difference"] < hi and val["verdict"] in (WITHIN, LARGER)
    assert val["verdict"] == (WITHIN if lo <= 0 <= hi else LARGER)
