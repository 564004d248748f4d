"""The global batch as a property of the experiment, the planner's levers in the
schema, and layouts the trainer cannot run refused at `trainlab validate`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import RECIPES, REPO
from trainlab.config import ExperimentConfig, load_config, to_yaml
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


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["parallel.tp=2", "parallel.dp=1"], "parallel.tp = 2"),
        (["parallel.pp=2", "parallel.dp=1"], "parallel.pp = 2"),
        (["parallel.strategy=auto", "parallel.tp=2"], "parallel.tp = 2"),
        (["parallel.strategy=auto", "parallel.pp=2"], "parallel.pp = 2"),
    ],
)
def test_tp_and_pp_are_refused_at_validate(base: Path, overrides: list[str], field: str):
    (line,) = problems(base, *overrides)
    assert f"{field}: trainlab executes data parallelism only" in line
    assert "not executed yet" in line


def test_sequence_parallel_and_partial_dp_are_refused(base: Path):
    (line,) = problems(base, "parallel.sequence_parallel=true")
    assert "parallel.sequence_parallel = True: needs tensor parallelism" in line
    (line,) = problems(base, "parallel.strategy=auto", "resource.num_workers=4", "parallel.dp=2")
    assert "parallel.dp = 2: must equal resource.num_workers (4)" in line
    assert load_config(base, ["parallel.tp=1", "parallel.pp=1"]).parallel.dp == 2


def test_constructing_in_code_refuses_tp_too():
    with pytest.raises(ValueError, match="parallel.tp = 2: trainlab executes data parallelism"):
        ExperimentConfig.model_validate(
            {"name": "x", "parallel": {"tp": 2}, "resource": {"num_workers": 2}}
        )


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
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("error: ") and "parallel.tp = 2: " in lines[0]
    assert "tensor parallelism is planned but not executed yet" in lines[0]
