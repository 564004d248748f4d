"""The loop's components (trainlab.train.loop.components): one added by import path
from the config runs on every rank and can stop the run with a checkpoint."""

from __future__ import annotations

import json

import pytest

from tests.train_helpers import dataset_dir, make_job, tiny_config
from tests.unit.train.layout_runner import run_layout

PATH = "tests.unit.train.loop_components:stop_after_four"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def test_a_component_from_the_config_acts_on_every_rank_and_stops_with_a_checkpoint(
    dataset, tmp_path
):
    cfg = tiny_config(
        dataset,
        data={"global_batch_size": 8, "micro_batch_size": 2},
        train={"total_steps": 10, "components": [PATH], "checkpoint": {"every_steps": 3}},
        resource={"num_workers": 2},
    )
    losses, summary = run_layout(make_job(cfg, tmp_path / "run"), 2, tmp_path / "out.json")
    assert summary["status"] == "stopped" and summary["final_step"] == 4
    assert "the test component stops at step 4" in summary["stop_reason"]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"run/logs/component-rank{rank}.json").read_text())
        assert seen == [1, 2, 3, 4]
    # The stop saved the step it stopped at (besides the cadence's step 3).
    assert (tmp_path / "run/checkpoints/step-00000004").is_dir()
    assert max(losses) <= 4


def test_a_component_path_is_checked_at_validate(dataset):
    with pytest.raises(ValueError, match="no module 'nowhere_such.mod'"):
        tiny_config(dataset, train={"components": ["nowhere_such.mod:make"]})
    with pytest.raises(ValueError, match="should match pattern"):
        tiny_config(dataset, train={"components": ["not a path"]})


def test_a_rollback_equals_a_run_that_skipped_the_window(dataset, tmp_path):
    """P0Guard in one process: a NaN at step 5, read one step late (no component
    acts at step 5), rolls back to step 3 and skips 4-5; the steps after it train
    on the restored state, bit for bit as a run told to skip 4-5 from the start."""
    from tests.train_helpers import local_loader
    from trainlab.train.loop.trainer import Trainer
    from trainlab.train.parallel.distributed import DistEnv

    def run(name, **train):
        cfg = tiny_config(
            dataset,
            train={
                "total_steps": 7,
                "log_interval": 2,
                "eval_interval": 100,
                "checkpoint": {"every_steps": 3, "keep_last": 10},
                **train,
            },
            tracking={"alerts": {"on_p0": "rollback_and_skip", "max_rollbacks": 1}},
        )
        job = make_job(cfg, tmp_path / name)
        return Trainer(job, local_loader(job), DistEnv()).fit()

    rolled = run("rolled", chaos={"nan_at_steps": [5]})
    skipped = run("skipped", skip_steps=[[4, 5]])
    assert rolled["status"] == skipped["status"] == "completed"
    assert rolled["rollbacks"] == [
        {"from_step": 5, "to_step": 3, "skipped": [4, 5], "rule": "non_finite"}
    ]
    assert rolled["weights_sha256"] == skipped["weights_sha256"]
