"""One checkpoint format (DCP) for every layout; a checkpoint of the single-file
format of trainlab's first versions (`model.pt` + `optimizer.pt`) is refused by
name, by a resume and by export, never half-read."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.train_helpers import dataset_dir, local_loader, make_job, tiny_config
from trainlab.run import checkpoints as ckpts
from trainlab.train import checkpoint as ck
from trainlab.train.loop.checkpointer import DCP_DIR, TRAINER_FILE
from trainlab.train.loop.state import ModelState
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def train(cfg, run_dir):
    job = make_job(cfg, run_dir)
    trainer = Trainer(job, local_loader(job), DistEnv())
    return trainer.fit(), trainer


def as_legacy(src, dst, job) -> None:
    """Checkpoint `src` rewritten as the torch format trainlab wrote for a
    one-process run before DCP only: full model and optimizer state dicts."""
    import torch.distributed.checkpoint as dcp

    model = ModelState(job.cfg, DistEnv())
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(src / DCP_DIR), no_dist=True)
    model.load_state_dict(state)
    staging = dst.parent / ".legacy-staging"
    staging.mkdir(parents=True)
    ck.save_file(model.model.state_dict(), staging / "model.pt")
    ck.save_file(model.optimizers.only().state_dict(), staging / "optimizer.pt")
    trainer_state = ck.load_file(src / TRAINER_FILE)
    ck.save_file({**trainer_state, "format": "torch"}, staging / TRAINER_FILE)
    shutil.copy(src / "rng-rank0.pt", staging / "rng-rank0.pt")
    meta = json.loads((src / ckpts.META_FILE).read_text())
    keep = {k: v for k, v in meta.items() if k not in ("files", "valid", "validated", "error")}
    ck.commit(staging, dst, {**keep, "format": "torch"}, None)


def test_every_layout_writes_dcp(dataset, tmp_path):
    cfg = tiny_config(dataset, train={"total_steps": 4, "checkpoint": {"every_steps": 2}})
    train(cfg, tmp_path / "run")
    step = tmp_path / "run/checkpoints/step-00000004"
    meta = json.loads((step / ckpts.META_FILE).read_text())
    assert meta["format"] == "dcp" and meta["valid"] is True
    assert (step / DCP_DIR / ".metadata").is_file()
    assert not (step / "model.pt").exists() and not (step / "optimizer.pt").exists()
    # validated by a forward of the whole model (it fits one process)
    assert meta["validation_loss"] is not None


def test_a_checkpoint_of_another_format_is_refused_by_name(dataset, tmp_path):
    from trainlab.errors import UserError
    from trainlab.export.source import CheckpointTensors

    cfg = tiny_config(
        dataset, train={"total_steps": 6, "checkpoint": {"every_steps": 3, "keep_last": 10}}
    )
    train(cfg, tmp_path / "clean")
    job = make_job(cfg, tmp_path / "scratch")
    legacy = tmp_path / "legacy/checkpoints/step-00000003"
    as_legacy(tmp_path / "clean/checkpoints/step-00000003", legacy, job)
    assert (legacy / "model.pt").is_file() and not (legacy / DCP_DIR).exists()
    with pytest.raises(RuntimeError, match="checkpoint format 'torch', which this trainlab"):
        train(cfg, tmp_path / "legacy")
    with pytest.raises(UserError, match="checkpoint format 'torch', which this trainlab"):
        CheckpointTensors(ckpts.read_info(legacy))
    assert not (tmp_path / "legacy/checkpoints/step-00000006").exists()  # nothing trained on


def test_zero1_writes_its_partition_and_reshards_both_ways(dataset, tmp_path):
    """ZeRO-1 (each rank steps a partition of the optimizer state) writes each
    rank's entries by parameter name: its checkpoint resumes on one process, and
    a one-process checkpoint resumes under ZeRO-1, on the same loss curve."""
    from tests.unit.train.layout_runner import run_layout

    def cfg(parallel, workers):
        return tiny_config(
            dataset,
            data={"global_batch_size": 8, "micro_batch_size": 2},
            train={"total_steps": 6, "log_interval": 1, "checkpoint": {"every_steps": 3}},
            parallel={"strategy": "ddp", **parallel},
            resource={"num_workers": workers},
        )

    zero1 = {"zero_stage": 1, "dp": 2}
    reference, _ = run_layout(make_job(cfg({}, 1), tmp_path / "one"), 1, tmp_path / "one.json")
    run = tmp_path / "run"
    first, _ = run_layout(make_job(cfg(zero1, 2), run), 2, tmp_path / "a.json", stop_at=3)
    second, summary = run_layout(make_job(cfg({}, 1), run), 1, tmp_path / "b.json")
    assert summary["start_step"] == 3
    for got in (first, second):
        for step, loss in got.items():
            assert loss == pytest.approx(reference[step], rel=1e-4), (step, got, reference)
    # and back: a one-process checkpoint of step 3 resumed under ZeRO-1
    back = tmp_path / "back"
    run_layout(make_job(cfg({}, 1), back), 1, tmp_path / "c.json", stop_at=3)
    third, summary = run_layout(make_job(cfg(zero1, 2), back), 2, tmp_path / "d.json")
    assert summary["start_step"] == 3 and sorted(third) == [4, 5, 6]
    for step, loss in third.items():
        assert loss == pytest.approx(reference[step], rel=1e-4), (step, third, reference)
