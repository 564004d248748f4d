"""The global batch as a property of the experiment, the planner's levers in the
schema, and layouts the trainer cannot run refused at `trainlab validate`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import RECIPES, REPO
from trainlab.config import load_config, to_yaml
from trainlab.errors import ConfigError

TINY = str(RECIPES / "tiny.yaml")


@pytest.fixture
def base(tmp_path: Path) -> Path:
    path = tmp_path / "base.yaml"
    path.write_text(
        textwrap.dedent(
            """
            name: base
            model: {arch: llama, hidden_size: 64, num_layers: 4, num_heads: 4, vocab_size: 512}
            data: {seq_len: 64, micro_batch_size: 2}
            train: {lr: 1.0e-3, warmup_steps: 5, total_steps: 50}
            parallel: {strategy: ddp}
            resource: {num_workers: 2}
            """
        )
    )
    return path


def problems(path: Path, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return e.value.lines


# --------------------------------------------------------------------------- global batch


def test_stated_global_batch_is_the_configs_and_fills_grad_accum(base: Path):
    cfg = load_config(base, ["data.global_batch_size=16"])
    assert cfg.global_batch_size == 16 and cfg.tokens_per_step == 16 * 64
    assert cfg.data.grad_accum_steps == 16 // (2 * 2)  # micro 2 x dp 2
    # Given too, it must agree.
    assert load_config(base, ["data.global_batch_size=16", "data.grad_accum_steps=4"]) == cfg


def test_without_global_batch_it_is_micro_x_accum_x_dp(base: Path):
    cfg = load_config(base, ["data.grad_accum_steps=3"])
    assert cfg.data.global_batch_size is None
    assert cfg.global_batch_size == 2 * 3 * 2 and cfg.tokens_per_step == 12 * 64
    assert load_config(base).data.grad_accum_steps == 1  # the default, as before


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["data.global_batch_size=6"],
            "data.global_batch_size = 6: must be a multiple of data.micro_batch_size (2) x "
            "parallel.dp (2) = 4",
        ),
        (
            ["data.global_batch_size=16", "data.grad_accum_steps=3"],
            "data.grad_accum_steps = 3: disagrees with data.global_batch_size (16): "
            "data.micro_batch_size (2) x data.grad_accum_steps (3) x parallel.dp (2) = 12",
        ),
        (
            ["parallel.strategy=auto", "data.global_batch_size=7"],
            "data.global_batch_size = 7: must be a multiple of data.micro_batch_size (2)",
        ),
        (
            ["parallel.strategy=auto", "data.global_batch_size=16", "data.grad_accum_steps=3"],
            "data.grad_accum_steps = 3: disagrees with data.global_batch_size (16)",
        ),
        (
            ["data.micro_batch_size=auto"],
            "data.micro_batch_size = 'auto': needs data.global_batch_size",
        ),
        (
            ["data.micro_batch_size=auto", "data.global_batch_size=5"],
            "data.global_batch_size = 5: must be a multiple of parallel.dp (2)",
        ),
    ],
)
def test_global_batch_rules(base: Path, overrides: list[str], expected: str):
    lines = problems(base, *overrides)
    assert len(lines) == 1 and expected in lines[0], lines


def test_auto_strategy_leaves_grad_accum_to_the_planner(base: Path, tmp_path: Path):
    over = ["parallel.strategy=auto", "data.global_batch_size=16"]
    cfg = load_config(base, over)
    assert cfg.data.grad_accum_steps is None and cfg.global_batch_size == 16
    # `show` output loads back to the same config (grad_accum_steps stays open).
    again = tmp_path / "resolved.yaml"
    again.write_text(to_yaml(cfg))
    assert load_config(again) == cfg
    auto = load_config(base, [*over, "data.micro_batch_size=auto"])
    assert auto.data.micro_batch_size == "auto" and auto.global_batch_size == 16


def test_recomputation_auto_is_allowed_and_none_stays_the_default(base: Path):
    assert load_config(base).parallel.activation_checkpointing == "none"
    cfg = load_config(base, ["parallel.activation_checkpointing=auto"])
    assert cfg.parallel.activation_checkpointing == "auto"
    assert problems(base, "parallel.activation_checkpointing=some")


# --------------------------------------------------------------------------- executable layouts


def test_tensor_and_pipeline_layouts_validate(base: Path):
    tp = load_config(base, ["parallel.tp=2", "parallel.dp=1"])
    assert (tp.parallel.tp, tp.parallel.pp, tp.parallel.dp) == (2, 1, 1)
    pp = load_config(base, ["parallel.pp=2", "parallel.dp=1"])
    assert pp.parallel.pp_schedule == "1f1b" and pp.parallel.pp_virtual_stages == 1
    # 2 rows per replica, micro batch 2: one data micro batch, so the pipeline takes 2 of 1
    assert pp.pipeline_microbatches == 2
    inter = load_config(
        base, ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=interleaved_1f1b"]
    )
    assert inter.parallel.pp_virtual_stages == 2
    sp = load_config(base, ["parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=true"])
    assert sp.parallel.sequence_parallel


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["resource.num_workers=4", "parallel.tp=2", "parallel.dp=2", "parallel.zero_stage=1"],
            "parallel.zero_stage = 1: ZeRO-1 (DDP with a sharded optimizer) does not compose",
        ),
        (
            ["parallel.pp=2", "parallel.dp=1", "parallel.pp_virtual_stages=2"],
            "parallel.pp_virtual_stages = 2: more than one stage per rank needs pp_schedule "
            "interleaved_1f1b",
        ),
        (
            ["parallel.pp=2", "parallel.dp=1", "parallel.pp_microbatches=3"],
            "parallel.pp_microbatches = 3: must divide the 2 rows per data-parallel rank",
        ),
        (
            ["parallel.pp=2", "parallel.dp=1", "parallel.pp_microbatches=1"],
            "parallel.pp_microbatches = 1: 1f1b needs at least pp (2)",
        ),
        (
            ["resource.num_workers=8", "parallel.pp=8", "parallel.dp=1"],
            "parallel.pp = 8: pp x pp_virtual_stages = 8 stages for 4 blocks",
        ),
        (
            ["parallel.pp=2", "parallel.dp=1", "train.precision=fp16", "resource.use_gpu=true"],
            "train.precision = 'fp16': pipeline parallelism runs without a loss scaler",
        ),
        (
            ["parallel.tp=2", "parallel.dp=1", "model.vocab_size=511"],
            "parallel.tp = 2: must divide model.vocab_size (511)",
        ),
        (
            ["parallel.sequence_parallel=true"],
            "parallel.sequence_parallel = True: shards over the tensor-parallel ranks",
        ),
    ],
)
def test_layouts_that_cannot_run_are_refused_at_validate(
    base: Path, overrides: list[str], expected: str
):
    lines = problems(base, *overrides)
    assert any(expected in line for line in lines), lines


def test_cli_validate_exits_2_with_one_line_naming_the_field():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainlab",
            "validate",
            TINY,
            "--set",
            "parallel.tp=2",
            "--set",
            "parallel.dp=1",
            "--set",
            "model.ffn_hidden_size=383",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("error: ") and "parallel.tp = 2: must divide model.ffn_hidden_size (383)" in lines[0]
