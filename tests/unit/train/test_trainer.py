"""The per-worker loop in one process (no Ray, no process group), on the real
stream of a small real prepared dataset."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.train_helpers import dataset_dir, local_loader, make_job, tiny_config
from trainlab.run import checkpoints as ckpts
from trainlab.train.loop.callbacks import Callback
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv

SUMMARY_KEYS = {
    "name",
    "status",
    "final_step",
    "final_loss",
    "val_loss",
    "tokens_seen",
    "restarts",
    "weights_sha256",
    "last_checkpoint",
    "best_checkpoint",
    "wall_seconds",
}


class Recorder(Callback):
    def __init__(self, stop_at: int | None = None):
        self.events: list[tuple] = []
        self.stop_at = stop_at

    def on_run_start(self, ctx):
        self.events.append(("start", ctx.start_step, ctx.restarts))

    def on_step_end(self, step, metrics):
        self.events.append(("step", step, dict(metrics)))
        if self.stop_at is not None and step >= self.stop_at:
            self.stop_requested, self.stop_reason = True, "test asked"

    def on_eval(self, step, val_losses):
        self.events.append(("eval", step, dict(val_losses)))

    def on_checkpoint(self, step, path, valid, val_loss):
        self.events.append(("checkpoint", step, valid))

    def on_run_end(self, summary):
        self.events.append(("end", summary["status"]))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def train(cfg, run_dir, callbacks=None):
    job = make_job(cfg, run_dir)
    trainer = Trainer(job, local_loader(job), DistEnv(), callbacks)
    return trainer.fit(), trainer


def test_trains_evaluates_checkpoints_and_summarizes(dataset, tmp_path):
    cfg = tiny_config(dataset, train={"total_steps": 24, "eval_interval": 8})
    rec = Recorder()
    summary, _ = train(cfg, tmp_path, rec)
    assert set(summary) >= SUMMARY_KEYS
    assert summary["status"] == "completed" and summary["final_step"] == 24
    assert summary["tokens_seen"] == 24 * 4 * 32
    assert summary["restarts"] == 0
    on_disk = json.loads((tmp_path / "run_summary.json").read_text())
    assert on_disk["weights_sha256"] == summary["weights_sha256"]
    # the process's peak (RSS on CPU) next to the plan's estimate per device
    assert summary["peak_memory_bytes"] > 0
    assert summary["planned_memory_bytes"] == make_job(cfg, tmp_path).plan[
        "memory_per_device_bytes"
    ]["total"]

    losses = [e[2]["loss"] for e in rec.events if e[0] == "step"]
    # it learns (deterministic run); each logged loss is one small batch's, so the
    # last three windows are averaged
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    first = next(e[2] for e in rec.events if e[0] == "step")
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "step_time_s",
        "data_wait_frac",
        "mem_gb",
        "mem_peak_gb",
        "ckpt_age_s",
        "eta_s",
        "share/code",
        "share/docs",
    ):
        assert key in first
    assert "mfu" not in first  # no resource.peak_tflops
    evals = [e for e in rec.events if e[0] == "eval"]
    assert [e[1] for e in evals] == [8, 16, 24]
    assert set(evals[-1][2]) == {"code", "docs", "all"}
    assert summary["val_loss"] == evals[-1][2]["all"]
    assert rec.events[0] == ("start", 0, 0) and rec.events[-1] == ("end", "completed")

    # every 4 steps, keep_last 2 + keep_best 1, all validated
    assert [e[1] for e in rec.events if e[0] == "checkpoint"] == [4, 8, 12, 16, 20, 24]
    kept = ckpts.committed(tmp_path / "checkpoints")
    assert {20, 24} <= {i.step for i in kept} and len(kept) <= 3
    assert all(i.valid and i.meta["validated"] for i in kept)
    assert summary["last_checkpoint"].endswith("step-00000024")
    assert summary["best_checkpoint"] in {str(i.path) for i in kept}


def test_mfu_reported_when_device_peak_is_known(dataset, tmp_path):
    cfg = tiny_config(dataset, train={"total_steps": 4}, resource={"peak_tflops": 1.0})
    rec = Recorder()
    train(cfg, tmp_path, rec)
    mfu = [e[2]["mfu"] for e in rec.events if e[0] == "step"]
    assert all(0 < m < 1 for m in mfu)


@pytest.mark.parametrize("model", [{"dropout": 0.1}, {"arch": "gpt2", "num_kv_heads": 4}])
def test_resume_from_checkpoint_gives_bitwise_identical_weights(dataset, tmp_path, model):
    """Deterministic mode: stopping after a checkpoint and resuming (model,
    optimizer, schedule, data position and RNG restored) ends on the same bits."""
    cfg = tiny_config(
        dataset,
        model=model,
        train={"total_steps": 10, "checkpoint": {"every_steps": 3, "keep_last": 10}},
    )
    clean, _ = train(cfg, tmp_path / "clean")

    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "clean/checkpoints/step-00000006", resumed_dir / "checkpoints/step-00000006"
    )
    rec = Recorder()
    resumed, trainer = train(cfg, resumed_dir, rec)
    assert rec.events[0][:2] == ("start", 6) and trainer.start_step == 6
    assert resumed["weights_sha256"] == clean["weights_sha256"]
    assert resumed["final_loss"] == clean["final_loss"]


def test_corrupted_newest_checkpoint_is_skipped_and_the_run_still_matches(
    dataset, tmp_path, caplog
):
    cfg = tiny_config(
        dataset, train={"total_steps": 9, "checkpoint": {"every_steps": 3, "keep_last": 10}}
    )
    clean, _ = train(cfg, tmp_path / "clean")
    broken = tmp_path / "broken"
    (broken / "checkpoints").mkdir(parents=True)
    for step in ("00000003", "00000006"):
        shutil.copytree(
            tmp_path / f"clean/checkpoints/step-{step}", broken / f"checkpoints/step-{step}"
        )
    # The largest file of the newest checkpoint (its DCP data: the weights), truncated.
    files = (broken / "checkpoints/step-00000006").rglob("*")
    model_file = max((f for f in files if f.is_file()), key=lambda f: f.stat().st_size)
    model_file.write_bytes(model_file.read_bytes()[:-100])
    rec = Recorder()
    resumed, _ = train(cfg, broken, rec)
    assert rec.events[0][:2] == ("start", 3)
    assert "skipping checkpoint" in caplog.text and "step-00000006" in caplog.text
    assert resumed["weights_sha256"] == clean["weights_sha256"]


def test_gradient_accumulation_matches_one_big_batch(dataset, tmp_path):
    one = tiny_config(
        dataset,
        data={"micro_batch_size": 4, "grad_accum_steps": 1},
        train={"total_steps": 3, "deterministic": False},
    )
    accum = tiny_config(
        dataset,
        data={"micro_batch_size": 2, "grad_accum_steps": 2},
        train={"total_steps": 3, "deterministic": False},
    )
    _, a = train(one, tmp_path / "one")
    _, b = train(accum, tmp_path / "accum")
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_a_callback_can_stop_the_run_with_a_checkpoint(dataset, tmp_path):
    cfg = tiny_config(dataset, train={"total_steps": 20, "checkpoint": {"every_steps": 100}})
    rec = Recorder(stop_at=4)
    summary, _ = train(cfg, tmp_path, rec)
    assert summary["status"] == "stopped" and summary["final_step"] == 4
    assert summary["stop_reason"] == "test asked"
    assert summary["last_checkpoint"].endswith("step-00000004")


def test_a_grad_spike_configured_as_p0_stops_the_run_at_its_step(dataset, tmp_path):
    """Any per-step rule set to P0 acts (not only non_finite): the rehearsed spike at
    step 9 stops the run there; the resume point is the checkpoint before it."""
    cfg = tiny_config(
        dataset,
        train={
            "total_steps": 14,
            "log_interval": 4,
            "checkpoint": {"every_steps": 4},
            "chaos": {"spike_at_steps": [9]},
        },
        tracking={"alerts": {"grad_spike": {"severity": "P0"}, "on_p0": "checkpoint_and_stop"}},
    )
    summary, _ = train(cfg, tmp_path)
    assert (summary["status"], summary["final_step"]) == ("stopped_by_alert", 9)
    assert "P0 alert grad_spike at step 9" in summary["stop_reason"]
    assert summary["last_checkpoint"].endswith("step-00000008")


def test_bf16_autocast_trains_on_cpu_close_to_fp32(dataset, tmp_path):
    fp32, _ = train(tiny_config(dataset, train={"total_steps": 4}), tmp_path / "fp32")
    bf16, _ = train(
        tiny_config(dataset, train={"total_steps": 4, "precision": "bf16"}), tmp_path / "bf16"
    )
    assert bf16["status"] == "completed"
    assert bf16["final_loss"] == pytest.approx(fp32["final_loss"], abs=0.05)
    assert bf16["weights_sha256"] != fp32["weights_sha256"]  # it did run in bf16


def test_activation_checkpointing_keeps_results_and_checkpoint_keys(dataset, tmp_path):
    plain = tiny_config(dataset, train={"total_steps": 3, "deterministic": False})
    recompute = tiny_config(
        dataset,
        train={"total_steps": 3, "deterministic": False},
        parallel={"activation_checkpointing": "full"},
    )
    a, _ = train(plain, tmp_path / "plain")
    b, _ = train(recompute, tmp_path / "recompute")
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-5)
    # checkpoints load into a plain model (no wrapper prefixes in the keys)
    assert ckpts.committed(tmp_path / "recompute/checkpoints")[-1].valid
