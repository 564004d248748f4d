"""An MoE model (model.moe) in the real Trainer, one process: it trains; with
aux-loss-free balancing the router bias moves once per optimizer step and a
kill and resume is bitwise; the aux loss gets the main loss's per-step scale
(trainlab.models.moe.layer says why that makes it accumulation-aware)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.train_helpers import dataset_dir, local_loader, make_job, tiny_config
from trainlab.train.loop.callbacks import Callback
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv

MOE = {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 32}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def moe_config(dataset, moe=None, **sections):
    model = {"moe": {**MOE, **(moe or {})}}
    return tiny_config(dataset, model=model, **sections)


def train(cfg, run_dir):
    job = make_job(cfg, run_dir)
    trainer = Trainer(job, local_loader(job), DistEnv())
    return trainer.fit(), trainer


def test_bias_balancing_resumes_bitwise(dataset, tmp_path):
    """balance: bias, stopped after the step-6 checkpoint and resumed: the same
    weights (router biases included: they are in the state dict) and loss."""
    cfg = moe_config(
        dataset,
        {"balance": "bias", "aux_loss_coef": 0.0, "bias_update_rate": 0.01},
        train={"total_steps": 8, "checkpoint": {"every_steps": 3, "keep_last": 10}},
    )
    clean, trainer = train(cfg, tmp_path / "clean")
    assert clean["status"] == "completed"
    biases = [layer.router.expert_bias for layer in trainer.state.model.moe_layers]
    # 8 steps of +-0.01 (one move per step): every entry is a multiple of 0.01, |.| <= 0.08
    for b in biases:
        steps = b / 0.01
        torch.testing.assert_close(steps, steps.round(), atol=1e-4, rtol=0)
        assert b.abs().max() <= 0.08 + 1e-6
    assert sum(float(b.abs().sum()) for b in biases) > 0
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "clean/checkpoints/step-00000006", resumed_dir / "checkpoints/step-00000006"
    )
    resumed, again = train(cfg, resumed_dir)
    assert again.start_step == 6
    assert resumed["weights_sha256"] == clean["weights_sha256"]
    assert resumed["final_loss"] == clean["final_loss"]


def test_the_step_gives_the_aux_loss_the_main_losss_scale(dataset, tmp_path):
    """Two accumulated micro batches: every MoE layer's aux loss is scaled by
    1 / the step's labelled tokens, the factor of the summed token losses (so it
    is a mean over the step, not a sum of per-micro-batch means)."""
    from trainlab.data import IGNORE_INDEX

    cfg = moe_config(dataset, data={"micro_batch_size": 2, "grad_accum_steps": 2},
                     train={"total_steps": 1, "warmup_steps": 0})  # fmt: skip
    job = make_job(cfg, tmp_path)
    logged = Logged()
    trainer = Trainer(job, local_loader(job), DistEnv(), logged)
    seen, step = [], trainer.train_step
    trainer.train_step = lambda batches: (seen.append(batches), step(batches))[1]
    summary = trainer.fit()
    assert summary["status"] == "completed"
    (batches,) = seen
    assert len(batches) == 2
    labelled = sum(int((torch.as_tensor(b["labels"]) != IGNORE_INDEX).sum()) for b in batches)
    for layer in trainer.state.model.moe_layers:
        assert float(layer.loss_scale) == pytest.approx(1.0 / labelled)
    # the logged step's router health goes with the other metrics (to MLflow)
    (metrics,) = logged.metrics
    assert metrics["moe/load_max_over_mean"] >= 1.0 and "moe_layer1/aux_loss" in metrics


class Logged(Callback):
    def __init__(self) -> None:
        self.metrics: list[dict] = []

    def on_step_end(self, step, metrics):
        self.metrics.append(dict(metrics))


def test_no_host_read_in_a_quiet_moe_step(dataset, tmp_path):
    """Dropless routing and the grouped experts (CPU fp32: torch._grouped_mm),
    the aux loss, the step's statistics and the bias update stay on the device:
    no `.item()` in step 2 (tests/unit/train/test_host_sync.py counts the same)."""
    from tests.unit.train.test_host_sync import config, host_reads_of_step_2

    cfg = config(dataset, {"strategy": "ddp"}, 1)
    raw = cfg.model_dump()
    raw["model"]["moe"] = {**MOE, "balance": "bias", "aux_loss_coef": 0.0}
    one = make_job(type(cfg).model_validate(raw), tmp_path / "one")
    assert host_reads_of_step_2(one, 0, 1, 0) == 0
    raw["model"]["moe"] = MOE  # the aux loss instead of the bias
    aux = make_job(type(cfg).model_validate(raw), tmp_path / "aux")
    assert host_reads_of_step_2(aux, 0, 1, 0) == 0
