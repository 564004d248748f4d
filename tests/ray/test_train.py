"""Training on the shared local Ray cluster, on a real prepared dataset read by
the real loader (Ray Data): DDP (through `trainlab train --smoke`) and FSDP
with 2 workers, a chaos kill that resumes bitwise-identically, and
max_failures exhausted.

Tiny model and few steps: the cost is starting Ray Train worker groups."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.train_helpers import dataset_dir, tiny_config
from trainlab.cli import cli
from trainlab.config import to_yaml
from trainlab.train import TrainingFailed, run
from trainlab.train.launcher import SMOKE_STEPS, smoke_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]

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


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def train(cfg, tmp_path, **kw):
    return run(cfg, base_dir=tmp_path, **kw)


def two_workers(dataset, parallel=None, **train):
    base = {
        "total_steps": 10,
        "log_interval": 2,
        "eval_interval": 5,
        "deterministic": True,
        "checkpoint": {"every_steps": 3, "keep_last": 2},
    }
    return tiny_config(
        dataset, resource={"num_workers": 2}, parallel=parallel or {}, train={**base, **train}
    )


def last_json_line(output: str) -> dict:
    """The run summary: the last line of stdout that is a JSON object."""
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON summary in {output[-2000:]!r}")


def test_ddp_smoke_kill_and_resume_match_an_uninterrupted_run(ray_cluster, dataset, tmp_path):
    """`trainlab train --smoke --json` (2 DDP workers, a worker killed, resumed from the
    validated checkpoint) ends bitwise-identical to the same steps uninterrupted."""
    cfg = two_workers(dataset)
    config_file = tmp_path / "exp.yaml"
    config_file.write_text(to_yaml(cfg))
    result = CliRunner().invoke(
        cli,
        [
            "train",
            str(config_file),
            "--smoke",
            "--json",
            "--set",
            f"train.runs_root={tmp_path / 'smoke'}",
        ],
        standalone_mode=False,
    )
    assert result.exception is None and result.return_value == 0, result.output[-3000:]
    killed = last_json_line(result.stdout)

    smoke = smoke_config(cfg)
    uninterrupted = smoke.model_copy(
        update={
            "train": smoke.train.model_copy(
                update={"chaos": smoke.train.chaos.model_copy(update={"kill_at_steps": []})}
            )
        }
    )
    clean = train(uninterrupted, tmp_path / "clean")

    assert set(clean) >= SUMMARY_KEYS and set(killed) >= SUMMARY_KEYS
    assert clean["status"] == killed["status"] == "completed"
    assert clean["restarts"] == 0 and killed["restarts"] == 1
    assert all(killed["smoke"]["checks"].values())
    assert killed["final_step"] == SMOKE_STEPS and killed["start_step"] == 3  # newest valid
    # bitwise identity of the killed-and-resumed run and the uninterrupted one
    assert killed["weights_sha256"] == clean["weights_sha256"]
    assert killed["final_loss"] == clean["final_loss"]

    # the failure is recorded with its step and rank (the survivor's error is too)
    chaos = [f for f in killed["failures"] if f["rank"] == 1]
    assert chaos and chaos[0]["step"] == 4 and chaos[0]["kind"] == "chaos"

    # the run directory
    rd = Path(killed["run_dir"])
    assert rd.parent.parent == tmp_path / "smoke" and rd.name == "unit-smoke"
    for name in (
        "config.yaml",
        "plan.json",
        "run_summary.json",
        "logs/rank0.log",
        "logs/rank1.log",
        "logs/driver.log",
    ):
        assert (rd / name).exists(), name
    line = (rd / "logs/rank1.log").read_text().splitlines()[0]
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ rank1 ", line), line
    assert json.loads((rd / "run_summary.json").read_text())["restarts"] == 1
    kept = sorted(p.name for p in (rd / "checkpoints").iterdir())
    assert kept[-1] == f"step-{SMOKE_STEPS:08d}" and len(kept) <= 3  # keep_last 2 + best 1


def test_fsdp_two_workers_saves_sharded_and_resumes(ray_cluster, dataset, tmp_path):
    """FSDP (ZeRO-3) with asynchronous sharded checkpoints; rank 0 killed at step 5.
    The step-2 checkpoint is committed before the step-4 one starts (one in flight
    at a time); the step-4 one may still be in flight when the kill comes."""
    cfg = two_workers(
        dataset,
        parallel={"strategy": "fsdp", "zero_stage": 3},
        total_steps=8,
        chaos={"kill_at_steps": [5], "kill_rank": 0},
        checkpoint={"every_steps": 2, "async_save": True, "keep_last": 1, "keep_best": 0},
    )
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["final_step"] == 8
    assert summary["restarts"] == 1 and summary["start_step"] in (2, 4)
    last = Path(summary["last_checkpoint"])
    assert sorted(p.name for p in last.parent.iterdir()) == ["step-00000008"]  # keep_last 1
    meta = json.loads((last / "checkpoint.json").read_text())
    assert meta["format"] == "dcp" and meta["valid"]
    assert any(f.startswith("state/") and f.endswith(".distcp") for f in meta["files"])


def test_max_failures_exhausted_ends_with_a_failure_summary(ray_cluster, dataset, tmp_path):
    cfg = two_workers(
        dataset,
        total_steps=8,
        max_failures=1,
        chaos={"kill_at_steps": [2, 5], "kill_rank": 1},
        checkpoint={"every_steps": 4},
    )
    with pytest.raises(TrainingFailed) as info:
        train(cfg, tmp_path)
    summary = info.value.summary
    assert summary["status"] == "failed" and "train.max_failures = 1" in summary["error"]
    by_step = {(f["step"], f["rank"]) for f in summary["failures"]}
    assert {(2, 1), (5, 1)} <= by_step
    assert summary["last_checkpoint"].endswith("step-00000004")
    on_disk = json.loads((tmp_path / "runs").glob("*/*/run_summary.json").__next__().read_text())
    assert on_disk["status"] == "failed" and len(on_disk["failures"]) == len(summary["failures"])
