"""`train.compile` through the CLI: `trainlab train trainers/recipes/tiny.yaml --set
train.compile=true` trains on CPU (each block compiled by torch.compile after
recomputation, trainlab.train.parallel.compile) and ends with the final loss of
`--set train.compile=false`, fp32, deterministic.

As small as the recipe allows: one worker, three steps, on the shared small
dataset. Compiling takes tens of seconds on 2 shared cores; it is the cost."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tests.conftest import RECIPES
from tests.train_helpers import dataset_dir
from trainlab.cli import cli

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SMALL = (
    "resource.num_workers=1",
    "train.total_steps=3",
    "train.warmup_steps=1",
    "train.log_interval=1",
    "train.eval_interval=3",
    "train.eval_batches=1",
    "train.checkpoint.every_steps=3",
    "train.deterministic=true",
    "data.seq_len=32",
    "data.micro_batch_size=2",
    "data.mix={code: 0.7, docs: 0.3}",
    "model.vocab_size=1024",
)


def _final(result) -> dict:
    for line in reversed(result.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(result.output[-3000:])


def test_compiled_blocks_train_to_the_eager_loss(ray_cluster, tmp_path_factory, tmp_path):
    dataset = dataset_dir(tmp_path_factory)
    summaries = {}
    for compile_ in ("true", "false"):
        sets = [*SMALL, f"data.path={dataset}", f"train.runs_root={tmp_path / compile_}"]
        sets.append(f"train.compile={compile_}")
        args = ["train", str(RECIPES / "tiny.yaml"), "--json"]
        for item in sets:
            args += ["--set", item]
        result = CliRunner().invoke(cli, args, standalone_mode=False)
        assert result.exception is None and result.return_value == 0, result.output[-3000:]
        summaries[compile_] = _final(result)
    compiled, eager = summaries["true"], summaries["false"]
    assert compiled["status"] == eager["status"] == "completed"
    assert compiled["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-4)
    log = (tmp_path / "true").rglob("rank0.log")
    assert any("compiled the transformer blocks" in p.read_text() for p in log)
