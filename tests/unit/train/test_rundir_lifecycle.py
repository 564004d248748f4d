"""A run's life on disk, driven through `launcher.run` up to where Ray would start:
a completed run is left byte-identical by a resume, `extend` continues it past its
total_steps and records what changed, a different experiment is refused with the
differing keys. The run itself is real: `launcher.run` with its Ray Train step
(`_fit`) replaced by the same trainer in this process (tests/unit/train/test_trainer.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from tests.train_helpers import dataset_dir, local_loader, tiny_config
from trainlab.config import config_hash
from trainlab.errors import UserError
from trainlab.train.driver import launcher
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv

STEPS = {"total_steps": 4, "eval_interval": 4, "log_interval": 2}


def fit_in_process(cfg, job):
    """launcher._fit without Ray: rank 0's trainer in this process."""
    return Trainer(job, local_loader(job), DistEnv()).fit()


def must_not_train(cfg, job):
    raise AssertionError(f"{job.run_dir}: a completed run was trained again")


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every path under root with its content hash and mtime (directories too)."""
    out = {}
    for p in sorted(root.rglob("*")):
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(root))] = (digest, p.stat().st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def completed(dataset, tmp_path_factory):
    """(config, run directory) of a real run that completed its 4 steps."""
    base = tmp_path_factory.mktemp("lifecycle")
    cfg = tiny_config(dataset, train=STEPS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launcher, "_fit", fit_in_process)
        summary = launcher.run(cfg, base_dir=base, callbacks=())
    assert summary["status"] == "completed" and summary["final_step"] == 4
    return cfg, Path(summary["run_dir"]), base


def copy_run(completed, tmp_path) -> Path:
    _, run_dir, _ = completed
    return Path(shutil.copytree(run_dir, tmp_path / "runs" / "2026-01-01" / run_dir.name))


def test_resuming_a_completed_run_touches_nothing(dataset, completed, monkeypatch):
    cfg, run_dir, base = completed
    monkeypatch.setattr(launcher, "_fit", must_not_train)
    before = snapshot(run_dir)
    assert "run_summary.json" in before and "config.yaml" in before
    by_name = launcher.run(cfg, resume=True, base_dir=base, callbacks=())
    by_dir = launcher.run(cfg, run_dir=run_dir, callbacks=())
    # the layout is not the experiment: a completed run is complete at any layout
    relaid = tiny_config(
        dataset, train=STEPS, parallel={"tp": 2, "dp": 1}, resource={"num_workers": 2}
    )
    by_layout = launcher.run(relaid, run_dir=run_dir, callbacks=())
    assert snapshot(run_dir) == before
    on_disk = json.loads((run_dir / "run_summary.json").read_text())
    for got in (by_name, by_dir, by_layout):
        assert got == {**on_disk, "already_complete": True}


def test_extend_continues_past_total_steps_and_records_it(
    dataset, completed, tmp_path, monkeypatch
):
    cfg, _, _ = completed
    run_dir = copy_run(completed, tmp_path)
    longer = tiny_config(dataset, train={**STEPS, "total_steps": 6})
    # without --extend a longer run is another experiment: refused, saying why and how
    before = snapshot(run_dir)
    with pytest.raises(UserError) as e:
        launcher.run(longer, run_dir=run_dir, callbacks=())
    msg = str(e.value)
    assert "holds a different experiment" in msg and "\n" not in msg
    assert "train.total_steps: 4 in the run, 6 now" in msg and "--extend" in msg
    with pytest.raises(UserError, match=r"N > 4"):
        launcher.run(cfg, run_dir=run_dir, extend=True, callbacks=())
    with pytest.raises(UserError, match=r"only train.total_steps may change.*train.lr"):
        other = tiny_config(dataset, train={**STEPS, "total_steps": 6, "lr": 1e-4})
        launcher.run(other, run_dir=run_dir, extend=True, callbacks=())
    assert snapshot(run_dir) == before  # refusals touch nothing either

    monkeypatch.setattr(launcher, "_fit", fit_in_process)
    summary = launcher.run(longer, run_dir=run_dir, extend=True, callbacks=())
    assert summary["status"] == "completed" and summary["final_step"] == 6
    assert summary["start_step"] == 4  # continued from the completed run's checkpoint
    # the run keeps its identity (its checkpoints carry it); what changed is recorded
    assert summary["config_hash"] == config_hash(cfg)
    (ext,) = summary["extensions"]
    assert ext["changed"] == {"train.total_steps": [4, 6]} and ext["at_step"] == 4
    assert ext["from_config_hash"] == config_hash(cfg)
    assert ext["config_hash"] == config_hash(longer)
    assert "total_steps: 6" in (run_dir / "config.yaml").read_text()

    # the extended run is complete in turn, and resuming it leaves it alone
    monkeypatch.setattr(launcher, "_fit", must_not_train)
    before = snapshot(run_dir)
    again = launcher.run(longer, run_dir=run_dir, callbacks=())
    assert again["already_complete"] and again["final_step"] == 6
    # repeating the --extend that made it this long is no new extension either
    repeated = launcher.run(longer, run_dir=run_dir, extend=True, callbacks=())
    assert repeated == again
    assert snapshot(run_dir) == before
