"""One small real swarm: four proxies as Ray Tune trials, each an ordinary trainlab
run nested under the swarm's MLflow parent run; then fit and propose on it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.train_helpers import dataset_dir, tiny_config
from trainlab.cli import main
from trainlab.config import to_yaml
from trainlab.mix.api import run_fit, run_propose

# ~110 s on 2 cores (four trials' Ray Train start-ups): run by `make test-all`;
# the fitting and proposing logic is tested in tests/unit/mix on synthetic swarms.
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.extended]


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    """`trainlab ARGS` in this process (on the session's cluster); the last stdout line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(list(args))
    return int(e.value.code or 0), json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_swarm_then_fit_and_propose(ray_cluster, tmp_path_factory, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = tiny_config(dataset_dir(tmp_path_factory), train={
        "total_steps": 3, "eval_interval": 3, "deterministic": False, "log_interval": 1,
        "checkpoint": {"every_steps": 3, "keep_last": 1, "validate": False},
        "runs_root": "runs"}, tracking={"system_metrics": False})
    config = tmp_path / "target.yaml"
    config.write_text(to_yaml(cfg))

    code, out = _cli(capsys, "mix", "swarm", str(config), "--runs", "4", "--concentration", "2",
                     "--proxy", "train.total_steps=2", "--proxy", "train.eval_interval=2",
                     "--proxy", "train.warmup_steps=1", "--json")
    assert code == 0
    assert {"swarm_id", "n_runs", "completed", "cost", "parent_run_id", "trials"} <= set(out)
    record = Path("runs/mix", out["swarm_id"], "swarm.json").resolve()
    rec = json.loads(record.read_text())
    assert rec["completed"] == 4 and rec["failed"] == 0 and rec["sources"] == ["code", "docs"]
    assert out["n_runs"] == 4 and out["parent_run_id"] == rec["parent_run_id"]
    for t in rec["trials"]:
        summary = json.loads((Path(t["run_dir"]) / "run_summary.json").read_text())
        assert summary["final_step"] == 2  # the proxy, not the target
        assert t["metrics"]["val_loss/code"] == pytest.approx(summary["val_losses"]["code"])
    assert len({tuple(t["mix"].values()) for t in rec["trials"]}) == 4
    c = rec["cost"]
    assert c["flops_fraction"] == pytest.approx(4 * 2 / 3) and c["swarm_wall_s"] > 0

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name(rec["experiment"])
    runs = client.search_runs([exp.experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == rec["parent_run_id"]]
    assert len(runs) == 5 and len(children) == 4
    parent = client.get_run(rec["parent_run_id"])
    assert parent.data.metrics["cost.flops_fraction"] == pytest.approx(c["flops_fraction"])

    fit = run_fit(rec["swarm_id"], "val_loss/docs", "loglinear", "runs")
    assert fit["n_runs"] == 4 and math.isfinite(fit["models"]["loglinear"]["rmse_cv"])
    prop = run_propose(rec["swarm_id"], "val_loss/docs", model="loglinear",
                       out=str(tmp_path / "proposal.yaml"), runs_root="runs")
    assert sum(prop["mix"].values()) == pytest.approx(1.0, abs=1e-6)

    # `mix confirm` trains through the same `run_trials` (2 more runs: left to the demo
    # measurement to keep this test's time down); its parts are unit-tested.
