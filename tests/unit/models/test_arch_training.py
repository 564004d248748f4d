"""Architectures brought by the user train through trainlab's own paths: the
real Trainer on 2 local gloo processes (tests/unit/train/layout_runner.py),
FSDP (ZeRO-3) over the model's repeated blocks, fp32, deterministic.

For a dense and an MoE transformers family and a user architecture from a file
outside the library, a run stopped after its step-3 checkpoint and resumed from
it ends with the weights and losses of the uninterrupted run, bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.train_helpers import dataset_dir, make_job, tiny_config
from tests.unit.train.layout_runner import run_layout

USER_EXAMPLE = REPO / "trainers" / "models"

ARCHS = {
    "hf:llama": {"arch": "hf:llama"},
    "hf:qwen3_moe": {
        "arch": "hf:qwen3_moe",
        "ffn_hidden_size": 32,
        "options": {"num_experts": 4, "num_experts_per_tok": 2},
    },
    "user": {
        "arch": "parallel_alibi:ParallelAlibi",
        "code_dir": str(USER_EXAMPLE),
        "options": {"alibi_max_bias": 4.0},
    },
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def config(dataset: Path, model: dict):
    return tiny_config(
        dataset,
        model=model,
        data={"global_batch_size": 8, "micro_batch_size": 2},
        train={
            "total_steps": 6,
            "log_interval": 1,
            "eval_interval": 3,
            "checkpoint": {"every_steps": 3},
        },
        parallel={"strategy": "fsdp", "zero_stage": 3},
        resource={"num_workers": 2},
    )


@pytest.mark.parametrize("name", list(ARCHS))
def test_stopped_and_resumed_fsdp_run_is_bitwise_the_uninterrupted_one(dataset, tmp_path, name):
    cfg = config(dataset, ARCHS[name])
    reference, ref_summary = run_layout(make_job(cfg, tmp_path / "ref"), 2, tmp_path / "ref.json")
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    assert all(0 < loss < 20 for loss in reference.values())
    run = tmp_path / "run"
    first, _ = run_layout(make_job(cfg, run), 2, tmp_path / "a.json", stop_at=3)
    assert sorted(first) == [1, 2, 3]
    shutil.rmtree(run / "checkpoints" / "step-00000006", ignore_errors=True)
    second, summary = run_layout(make_job(cfg, run), 2, tmp_path / "b.json")
    assert summary["start_step"] == 3 and summary["status"] == "completed"
    assert {**first, **second} == reference  # every logged loss, exactly
    assert summary["weights_sha256"] == ref_summary["weights_sha256"]
    assert summary["val_loss"] == ref_summary["val_loss"]


def test_hf_tensor_parallel_from_the_familys_plan_matches_one_process(dataset, tmp_path):
    """hf:llama on tp=2 (its base_model_tp_plan: q/k/v and gate/up column-wise, o
    and down row-wise) follows the one-process loss curve (relative 1e-4), and a
    run stopped at step 3 resumes at dp=2 FSDP from the sharded checkpoint."""
    model = {"arch": "hf:llama"}

    def cfg(parallel: dict, workers: int):
        return tiny_config(
            dataset,
            model=model,
            data={"global_batch_size": 8, "micro_batch_size": 2},
            train={"total_steps": 6, "log_interval": 1, "eval_interval": 3,
                   "checkpoint": {"every_steps": 3}},
            parallel={"strategy": "ddp", **parallel},
            resource={"num_workers": workers},
        )  # fmt: skip

    reference, _ = run_layout(make_job(cfg({}, 1), tmp_path / "one"), 1, tmp_path / "one.json")
    run = tmp_path / "run"
    first, _ = run_layout(
        make_job(cfg({"tp": 2, "dp": 1}, 2), run), 2, tmp_path / "a.json", stop_at=3
    )
    fsdp = {"strategy": "fsdp", "zero_stage": 3, "dp": 2}
    second, summary = run_layout(make_job(cfg(fsdp, 2), run), 2, tmp_path / "b.json")
    assert summary["start_step"] == 3
    for step, loss in {**first, **second}.items():
        assert loss == pytest.approx(reference[step], rel=1e-4), (step, first, second, reference)
