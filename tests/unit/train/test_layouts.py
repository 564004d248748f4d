"""Tensor and pipeline parallelism compute the same model: the real Trainer on
local gloo processes (tests/unit/train/layout_runner.py), fp32, deterministic.

Every layout's loss curve matches the one-process run step by step (relative
1e-4; measured differences are ~1e-7), and a run stopped at one layout and
resumed at another (the checkpoint resharded) continues the same curve.
Two-layer models, 6 steps: what costs is starting processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train_helpers import dataset_dir, make_job, tiny_config
from tests.unit.train.layout_runner import run_layout
from trainlab.train.parallel.mesh import MeshLayout, check_tp_groups
from trainlab.train.parallel.pipeline import stage_units

STEPS = 6
RTOL = 1e-4


def config(dataset: Path, parallel: dict, workers: int, **model):
    return tiny_config(
        dataset,
        model=model,
        data={"global_batch_size": 8, "micro_batch_size": 2},
        train={
            "total_steps": STEPS,
            "log_interval": 1,
            "eval_interval": 3,
            "checkpoint": {"every_steps": 3},
        },
        parallel={"strategy": "ddp", **parallel},
        resource={"num_workers": workers},
    )


def assert_same_curve(got: dict[int, float], reference: dict[int, float]) -> None:
    for step, loss in got.items():
        assert loss == pytest.approx(reference[step], rel=RTOL), (step, got, reference)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def test_tp_pp_tied_llama_matches_one_process_and_reshards_to_fsdp_pipeline(
    dataset, tmp_path
):
    """Llama (grouped-query attention, tied embeddings) on tp=2 x pp=2 (1F1B), stopped
    at step 3, resumed at pp=2 (interleaved, 2 virtual stages) x dp=2 FSDP: the
    steps before and after the reshard follow the one-process curve."""
    reference, ref_summary = run_layout(
        make_job(config(dataset, {}, 1), tmp_path / "one"), 1, tmp_path / "one.json"
    )
    run = tmp_path / "run"
    first, _ = run_layout(
        make_job(config(dataset, {"tp": 2, "pp": 2, "dp": 1}, 4), run),
        4,
        tmp_path / "a.json",
        stop_at=3,
    )
    assert sorted(first) == [1, 2, 3]
    assert_same_curve(first, reference)
    resumed = {
        "pp": 2,
        "dp": 2,
        "strategy": "fsdp",
        "zero_stage": 3,
        "pp_schedule": "interleaved_1f1b",
    }
    second, summary = run_layout(make_job(config(dataset, resumed, 4), run), 4, tmp_path / "b.json")
    assert summary["start_step"] == 3 and summary["status"] == "completed"
    assert sorted(second) == [4, 5, 6]
    assert_same_curve(second, reference)
    assert summary["val_loss"] == pytest.approx(ref_summary["val_loss"], rel=RTOL)
    meta = (run / "checkpoints" / "step-00000006" / "checkpoint.json").read_text()
    assert '"format": "dcp"' in meta and '"valid": true' in meta


def test_gpt2_tensor_parallel_matches_and_reshards_to_one_process(dataset, tmp_path):
    """GPT-2 (learned positions, biases) on tp=2, stopped at step 3 and resumed by one
    process from the sharded checkpoint."""
    gpt2 = {"arch": "gpt2", "num_kv_heads": None}
    reference, _ = run_layout(
        make_job(config(dataset, {}, 1, **gpt2), tmp_path / "one"), 1, tmp_path / "one.json"
    )
    run = tmp_path / "run"
    first, _ = run_layout(
        make_job(config(dataset, {"tp": 2, "dp": 1}, 2, **gpt2), run),
        2,
        tmp_path / "a.json",
        stop_at=3,
    )
    assert_same_curve(first, reference)
    second, summary = run_layout(
        make_job(config(dataset, {}, 1, **gpt2), run), 1, tmp_path / "b.json"
    )
    assert summary["start_step"] == 3 and sorted(second) == [4, 5, 6]
    assert_same_curve(second, reference)


# --------------------------------------------------------------------------- layout maths


def test_ranks_are_pp_major_tp_minor_and_tp_groups_stay_on_a_host():
    lay = MeshLayout(tp=2, pp=2, dp=2)
    assert [lay.coords(r) for r in (0, 1, 2, 5, 7)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (1, 0, 1),
        (1, 1, 1),
    ]
    assert lay.tp_groups()[:2] == [[0, 1], [2, 3]]
    check_tp_groups(lay, ["a"] * 4 + ["b"] * 4)
    with pytest.raises(RuntimeError, match=r"ranks \[2, 3\] spans hosts \['a', 'b'\]"):
        check_tp_groups(lay, ["a", "a", "a", "b", "b", "b", "b", "b"])


def test_stages_balance_embedding_and_head_as_a_block_each():
    assert stage_units(2, 2) == [(0, 2), (2, 4)]  # [embed, block 0] [block 1, head]
    assert stage_units(2, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_units(6, 2) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError):
        stage_units(2, 5)
