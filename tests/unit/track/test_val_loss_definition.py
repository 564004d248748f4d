"""One val-loss definition everywhere: `val_loss` is the held-out evaluation at a
step (the latest one in a summary or a comparison row), `best_val_loss` the
lowest of the run's evaluations; a run whose loss rises at the end tells them
apart."""

from __future__ import annotations

import json

import pytest

from tests.train_helpers import dataset_dir, local_loader, make_job
from tests.train_helpers import tiny_config as train_config
from tests.unit.track.conftest import FakeRank0, tiny_config
from trainlab.track import tracking_uri
from trainlab.track.query import compare_runs
from trainlab.train.loop.callbacks import Callback
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv


def test_compare_shows_the_latest_and_the_lowest_evaluation(runs_root, capsys):
    run = FakeRank0(tiny_config(runs_root), runs_root)
    run.start()
    run.steps(1, 60, loss=lambda s: abs(s - 30) / 10 + 1)  # evals at 20, 40, 60: 2, 2, 4 (+0.3)
    run.end()
    (row,) = compare_runs(tracking_uri(runs_root))
    assert row["val_loss"] == pytest.approx(4.3) and row["best_val_loss"] == pytest.approx(2.3)

    from trainlab.cli import main

    with pytest.raises(SystemExit):
        main(["compare", "--runs-root", str(runs_root)])
    out = capsys.readouterr().out
    assert "val loss" in out and "best val loss" in out and "4.3000" in out and "2.3000" in out
    assert "best val loss: the lowest of the run's evaluations" in out


class Evals(Callback):
    def __init__(self):
        self.evals: dict[int, float] = {}

    def on_eval(self, step, val_losses):
        self.evals[step] = val_losses["all"]


def test_the_run_summary_has_the_latest_and_the_lowest_evaluation(tmp_path_factory, tmp_path):
    cfg = train_config(dataset_dir(tmp_path_factory), train={"total_steps": 8, "eval_interval": 4})
    job = make_job(cfg, tmp_path)
    evals = Evals()
    summary = Trainer(job, local_loader(job), DistEnv(), evals).fit()
    assert sorted(evals.evals) == [4, 8]
    assert summary["val_loss"] == evals.evals[8]
    assert summary["best_val_loss"] == min(evals.evals.values())
    on_disk = json.loads((tmp_path / "run_summary.json").read_text())
    assert on_disk["best_val_loss"] == summary["best_val_loss"]
