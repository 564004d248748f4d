"""P0 actions on the real supervised path (2 DDP workers on the shared Ray cluster,
the real loader, deterministic mode): a rehearsed NaN (`train.chaos.nan_at_steps`)
stops the run at its step with a finite, valid resume point and exit code 4, or is
rolled back and its data window skipped, ending bitwise-equal to a run that
skipped the same window from the start. Both ranks must take the same decision
at the same step, or the run would hang in a collective."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.train_helpers import dataset_dir, tiny_config
from trainlab import exitcodes
from trainlab.cli import cli
from trainlab.config import to_yaml
from trainlab.monitor import alert_log_path
from trainlab.run import checkpoints as ckpts
from trainlab.train import run
from trainlab.train.loop.checkpointer import load_weights_on_cpu

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NAN_AT = 5
CKPT_EVERY = 3  # the newest valid checkpoint before the NaN: step 3


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def two_workers(dataset, train=None, alerts=None):
    base = {
        "total_steps": 6,
        "log_interval": 4,  # the NaN step is not a logged step
        "eval_interval": 3,
        "deterministic": True,
        "checkpoint": {"every_steps": CKPT_EVERY, "keep_last": 5},
    }
    return tiny_config(
        dataset,
        purpose="rehearse P0 handling",
        expectation="the NaN is acted on at its step",
        resource={"num_workers": 2},
        train={**base, **(train or {})},
        tracking={"alerts": alerts or {}},
    )


def test_nan_with_checkpoint_and_stop_stops_at_its_step_with_exit_code_4(
    ray_cluster, dataset, tmp_path, monkeypatch
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = two_workers(
        dataset,
        train={"chaos": {"nan_at_steps": [NAN_AT]}},
        alerts={"on_p0": "checkpoint_and_stop"},
    )
    config_file = tmp_path / "exp.yaml"
    config_file.write_text(to_yaml(cfg))
    result = CliRunner().invoke(
        cli,
        ["train", str(config_file), "--json", "--set", f"train.runs_root={tmp_path / 'runs'}"],
        standalone_mode=False,
    )
    assert result.exception is None, result.output[-3000:]
    assert result.return_value == exitcodes.STOPPED_BY_ALERT == 4
    summary = json.loads(
        next(line for line in reversed(result.stdout.splitlines()) if line.startswith("{"))
    )
    assert summary["status"] == "stopped_by_alert" and summary["final_step"] == NAN_AT
    assert "non_finite at step 5" in summary["stop_reason"]
    assert summary["resume_step"] == CKPT_EVERY

    run_dir = Path(summary["run_dir"])
    on_disk = json.loads((run_dir / "run_summary.json").read_text())
    assert on_disk["status"] == "stopped_by_alert" and on_disk["rollbacks"] == []
    # the resume point: valid, finite, before the NaN; nothing after it was saved
    infos = ckpts.committed(run_dir / "checkpoints")
    assert [i.step for i in infos] == [CKPT_EVERY]
    resume = ckpts.find_resume(run_dir / "checkpoints")
    assert resume is not None and resume.step == CKPT_EVERY and resume.valid
    model = load_weights_on_cpu(resume.path, cfg)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    alerts = [json.loads(x) for x in alert_log_path(run_dir).read_text().splitlines()]
    assert [(a["rule"], a["step"], a["severity"]) for a in alerts] == [("non_finite", NAN_AT, "P0")]


def test_nan_with_rollback_and_skip_equals_a_run_that_skipped_the_window(
    ray_cluster, dataset, tmp_path, monkeypatch
):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    rolled = run(
        two_workers(
            dataset,
            train={"chaos": {"nan_at_steps": [NAN_AT]}},
            alerts={"on_p0": "rollback_and_skip", "max_rollbacks": 1},
        ),
        base_dir=tmp_path / "rolled",
    )
    skipped = run(
        two_workers(dataset, train={"skip_steps": [[CKPT_EVERY + 1, NAN_AT]]}),
        base_dir=tmp_path / "skipped",
    )
    record = {
        "from_step": NAN_AT,
        "to_step": CKPT_EVERY,
        "skipped": [CKPT_EVERY + 1, NAN_AT],
        "rule": "non_finite",
    }
    assert rolled["status"] == skipped["status"] == "completed"
    assert rolled["final_step"] == skipped["final_step"] == 6
    assert rolled["rollbacks"] == [record] and skipped["rollbacks"] == []
    assert json.loads((Path(rolled["run_dir"]) / "run_summary.json").read_text())["rollbacks"] == [
        record
    ]
    assert rolled["final_loss"] is not None and math.isfinite(rolled["final_loss"])
    # bitwise: the rollback skipped exactly the window a from-the-start skip does
    assert rolled["weights_sha256"] == skipped["weights_sha256"]
    assert rolled["final_loss"] == skipped["final_loss"]

    client = MlflowClient(f"sqlite:///{tmp_path / 'rolled' / 'runs' / 'mlflow.db'}")
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert json.loads(mlrun.data.tags["rollback.1"]) == record
    assert mlrun.data.tags["rollbacks"] == "1"
