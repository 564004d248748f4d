"""`trainlab data at-step` against what a real (in-process) run consumed: the same
rows in the same order, their text, and provenance (doc_id, shard file and row)
that reads back from the shards; a run's skipped window is reported as such."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from tests.train_helpers import dataset_dir, local_loader, make_job, tiny_config
from trainlab.cli import cli
from trainlab.config import to_yaml
from trainlab.data.at_step import rows_at_step
from trainlab.errors import UserError
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv

STEPS = 6
SKIP = [3, 4]


class RecordingLoader:
    """The real loader, keeping every batch the trainer took (by 1-based step)."""

    def __init__(self, inner):
        self.inner, self.consumed = inner, {}

    def iter_from(self, step):
        for got, micro_batches in self.inner.iter_from(step):
            self.consumed[got + 1] = micro_batches
            yield got, micro_batches

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    dataset = dataset_dir(tmp_path_factory)
    cfg = tiny_config(
        dataset,
        train={
            "total_steps": STEPS,
            "eval_interval": 100,
            "skip_steps": [SKIP],
            "checkpoint": {"every_steps": 100},
        },
    )
    run_dir = tmp_path_factory.mktemp("at-step-run")
    job = make_job(cfg, run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(job.cfg))
    loader = RecordingLoader(local_loader(job))
    summary = Trainer(job, loader, DistEnv()).fit()
    assert summary["status"] == "completed"
    return cfg, run_dir, loader.consumed


def test_rows_agree_with_the_batches_the_run_trained_on(trained):
    from tokenizers import Tokenizer

    cfg, run_dir, consumed = trained
    assert sorted(consumed) == [1, 2, 5, 6]  # the skipped window was never read
    tokenizer = Tokenizer.from_file(str(Path(cfg.data.path) / "tokenizer.json"))
    for step, micro_batches in consumed.items():
        report = rows_at_step(cfg, step, decode=True, run_dir=run_dir)
        trained_rows = [r for mb in micro_batches for r in mb["input_ids"].tolist()]
        assert report["step"] == step and "skipped" not in report
        assert [r["text"] for r in report["rows"]] == [
            tokenizer.decode(r, skip_special_tokens=False) for r in trained_rows
        ]
        for row in report["rows"]:
            assert set(row) == {"source", "doc_ids", "shard", "row", "tokens", "text"}
            assert sum(row["tokens"]) == cfg.data.seq_len  # training rows are full
            for doc_id, shard, index in zip(row["doc_ids"], row["shard"], row["row"], strict=True):
                assert shard.startswith(row["source"] + "/")
                table = pq.read_table(Path(cfg.data.path) / shard, columns=["doc_id"])
                assert table.column("doc_id")[index].as_py() == doc_id


def test_cli_json_shape_for_a_run_dir_and_its_skipped_steps(trained):
    _, run_dir, consumed = trained
    out = CliRunner().invoke(
        cli, ["data", "at-step", str(run_dir), "2", "--rows", "3", "--json"], standalone_mode=False
    )
    assert out.exception is None, out.output
    report = json.loads(out.stdout)
    assert set(report) == {"step", "rows"} and report["step"] == 2 and len(report["rows"]) == 3
    assert set(report["rows"][0]) == {"source", "doc_ids", "shard", "row", "tokens"}
    skipped = CliRunner().invoke(
        cli, ["data", "at-step", str(run_dir), "3", "--json"], standalone_mode=False
    )
    assert json.loads(skipped.stdout)["skipped"] is True
    config = CliRunner().invoke(
        cli, ["data", "at-step", str(run_dir / "config.yaml"), "3", "--json"], standalone_mode=False
    )
    assert json.loads(config.stdout)["skipped"] is True  # the config's own skip_steps


def test_a_step_outside_the_run_is_bad_input(trained):
    cfg, run_dir, _ = trained
    with pytest.raises(UserError, match=r"STEP 0: must be in 1\.\.train\.total_steps"):
        rows_at_step(cfg, 0)
    with pytest.raises(UserError, match="STEP 7"):
        rows_at_step(cfg, STEPS + 1)
