"""Everything the driver decides before Ray starts: run directories, resume
checks, the smoke rehearsal's config, refused layouts, CLI errors (no Ray)."""

from __future__ import annotations

import datetime as dt
import json
import os

import pytest
from click.testing import CliRunner

from tests.train_helpers import dataset_dir, tiny_config
from trainlab.cli import cli
from trainlab.config import config_hash
from trainlab.errors import UserError
from trainlab.run import dir as rundir
from trainlab.run.records import failure_cause
from trainlab.train.driver import launcher


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def test_new_run_dirs_are_dated_absolute_and_never_reused(dataset, tmp_path):
    cfg = tiny_config(dataset)
    day = dt.date(2026, 3, 1)
    first = rundir.new_run_dir(cfg, tmp_path, day).local_path()
    assert first == tmp_path / "runs" / "2026-03-01" / "unit" and first.is_absolute()
    first.mkdir(parents=True)
    second = rundir.new_run_dir(cfg, tmp_path, day).local_path()
    assert second.name == "unit-2"
    second.mkdir()
    assert rundir.new_run_dir(cfg, tmp_path, day).name == "unit-3"


def test_resume_picks_the_latest_run_of_the_name(dataset, tmp_path):
    cfg = tiny_config(dataset)
    with pytest.raises(UserError, match="no earlier run named 'unit'"):
        rundir.choose_run_dir(cfg, resume=True, base_dir=tmp_path)
    older = tmp_path / "runs/2026-01-01/unit"
    newer = tmp_path / "runs/2026-01-02/unit-2"
    other = tmp_path / "runs/2026-01-03/unitary"
    for i, d in enumerate((older, newer, other)):
        d.mkdir(parents=True)
        (d / "config.yaml").write_text("x")
        os.utime(d / "config.yaml", (1000 + i, 1000 + i))
    assert rundir.choose_run_dir(cfg, resume=True, base_dir=tmp_path).local == newer


def test_run_dir_of_another_experiment_is_refused(dataset, tmp_path):
    cfg = tiny_config(dataset)
    rundir.write_run_files(tmp_path, cfg, {"plan": 1})
    rundir.check_same_experiment(tmp_path, cfg)  # the same experiment: fine
    changed = tiny_config(dataset, train={"lr": 1e-4})
    with pytest.raises(UserError, match="holds a different experiment"):
        rundir.check_same_experiment(tmp_path, changed)
    # operational settings are not the experiment's identity, nor is the layout
    rundir.check_same_experiment(tmp_path, tiny_config(dataset, train={"max_failures": 9}))
    relaid = tiny_config(dataset, parallel={"tp": 2, "dp": 1}, resource={"num_workers": 2})
    rundir.check_same_experiment(tmp_path, relaid)
    # ... as long as each step sees the same global batch (2 replicas would double it)
    with pytest.raises(UserError, match="holds a different experiment"):
        rundir.check_same_experiment(tmp_path, tiny_config(dataset, resource={"num_workers": 2}))


def test_checkpoint_of_another_dataset_is_refused_unless_allowed(dataset, tmp_path):
    cfg = tiny_config(dataset)
    ckpt = tmp_path / "checkpoints" / "step-00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.pt").write_bytes(b"x")
    from trainlab.fileutil import sha256_file

    meta = {
        "step": 4,
        "format": "dcp",
        "valid": True,
        "config_hash": config_hash(cfg),
        "dataset_fingerprint": "old",
        "files": {"trainer.pt": {"bytes": 1, "sha256": sha256_file(ckpt / "trainer.pt")}},
    }
    (ckpt / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="allow_fingerprint_change"):
        launcher.check_resumable(tmp_path, cfg, config_hash(cfg), launcher.prepare_data(cfg))
    allowed = tiny_config(dataset, data={"allow_fingerprint_change": True})
    launcher.check_resumable(tmp_path, allowed, config_hash(cfg), launcher.prepare_data(allowed))
    with pytest.raises(UserError, match="config hash"):
        launcher.check_resumable(tmp_path, cfg, "another-hash", launcher.prepare_data(cfg))


def test_smoke_rehearses_a_kill_and_a_validated_resume(dataset):
    cfg = tiny_config(
        dataset, resource={"num_workers": 2}, train={"total_steps": 500, "max_failures": 0}
    )
    smoke = launcher.smoke_config(cfg)
    t = smoke.train
    assert smoke.name == "unit-smoke" and t.total_steps == launcher.SMOKE_STEPS
    assert t.checkpoint.every_steps < t.chaos.kill_at_steps[0] < t.total_steps
    assert t.checkpoint.validate and t.max_failures >= 1 and t.chaos.kill_rank == 1
    assert smoke.model == cfg.model and smoke.data == cfg.data and smoke.parallel == cfg.parallel


def test_tensor_and_pipeline_layouts_reach_the_launcher_resolved(dataset):
    """What validates runs: the launcher resolves tp/pp layouts as configured."""
    for parallel in ({"strategy": "ddp", "tp": 2}, {"strategy": "fsdp", "pp": 2}):
        cfg = tiny_config(dataset, resource={"num_workers": 2}, parallel=parallel)
        resolved, plan_json = launcher.prepare_layout(cfg)
        assert (resolved.parallel.tp or 1) * (resolved.parallel.pp or 1) == 2
        assert plan_json["parallel"]["dp"] == 1


def test_a_plan_that_does_not_fit_is_refused(dataset):
    cfg = tiny_config(dataset, resource={"cpu_memory_gb": 0.001})
    with pytest.raises(UserError, match="does not fit"):
        launcher.prepare_layout(cfg)


def test_unknown_attention_is_refused_before_launch(dataset):
    # Refused by the config itself now (torch-free, at `trainlab validate`), so no
    # launch can even be prepared with it (tests/unit/cli/test_config_cmds.py).
    with pytest.raises(ValueError, match="unknown attention"):
        tiny_config(dataset, model={"attention": "flashy"})


def test_failure_cause_follows_the_last_failure():
    crash = {"event": "a", "kind": "error"}
    killed = [{"event": "b", "kind": "chaos"}, {"event": "b", "kind": "peer"}]
    assert failure_cause([crash]) == "code"
    assert failure_cause([crash, *killed]) == "infrastructure"
    assert failure_cause([*killed, {"event": "c", "kind": "error"}]) == "code"
    # a lost worker's peer reporting its broken connection later, as its own event
    lost = {"event": "d", "kind": "lost"}
    assert failure_cause([crash, lost, {"event": "e", "kind": "peer"}]) == "infrastructure"
    assert failure_cause([{"event": "f", "kind": "peer"}]) == "code"


def test_cli_bad_input_exits_2_before_anything_runs(dataset, tmp_path):
    runner = CliRunner()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"name: c\npurpose: p\nexpectation: e\ndata: {{path: {tmp_path / 'nowhere'}}}\n")
    res = runner.invoke(
        cli, ["train", str(cfg), "--run-dir", str(tmp_path), "--resume"], standalone_mode=False
    )
    assert isinstance(res.exception, UserError) and "give one" in str(res.exception)
    res = runner.invoke(cli, ["train", str(cfg), "--set", "train.lr=-1"], standalone_mode=False)
    assert isinstance(res.exception, UserError) and "train.lr" in str(res.exception)
    res = runner.invoke(cli, ["train", str(cfg)], standalone_mode=False)
    assert isinstance(res.exception, UserError) and "nowhere" in str(res.exception)
    assert not (tmp_path / "runs").exists()  # nothing half-written


def test_a_run_dir_that_is_not_a_run_directory_is_refused_before_anything_is_written(
    dataset, tmp_path
):
    """`--run-dir` on a folder of the user's files (or the repository root) is
    refused in one line; nothing lands beside the user's file."""
    from trainlab.train.driver.launcher import run

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    with pytest.raises(UserError, match=r"not a trainlab run directory \(no config.yaml; it "
                                        r"holds notes.txt\); give a new or empty directory"):  # fmt: skip
        run(tiny_config(dataset), run_dir=mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    # A new, an empty, or a run directory are fine (checked without training here).
    for ok in (tmp_path / "new", tmp_path / "empty"):
        rundir.check_usable(rundir.choose_run_dir(tiny_config(dataset), ok))
    (tmp_path / "empty").mkdir()
    rundir.write_run_files(tmp_path / "run", tiny_config(dataset), {})
    for ok in (tmp_path / "empty", tmp_path / "run"):
        rundir.check_usable(rundir.choose_run_dir(tiny_config(dataset), ok))


def test_two_starts_of_one_config_take_two_names(dataset, tmp_path):
    """A second start that chose the same new name a moment after the first took
    it moves on to the next free name instead of being refused."""

    from trainlab.run.lock import RunLock

    cfg = tiny_config(dataset)
    first = rundir.choose_run_dir(cfg, None, False, tmp_path)
    with RunLock.acquire(first), launcher._StoreUsers() as stack:
        second = launcher._lock_new(stack, first, cfg, tmp_path)
        assert second.local.name == f"{first.local.name}-2"


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("os:system", "TypeError"),  # a callable, not a factory of components
        ("builtins:list", "is not a Component"),  # returns no components
        ("tests.train_helpers:no_such_factory", "AttributeError"),
    ],
)
def test_a_component_that_cannot_be_built_is_refused_before_ray_starts(dataset, path, said):
    """A factory that fails would fail on every rank at every restart (it was
    retried train.max_failures times): refused once, as the config's problem."""
    cfg = tiny_config(dataset, train={"components": [path]})
    with pytest.raises(UserError, match=f"train.components: '{path}' failed to build.*{said}"):
        launcher._checked_together(cfg)
    good = tiny_config(
        dataset, train={"components": ["tests.e2e.elastic_components:pace_below_three"]}
    )
    launcher._checked_together(good)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_refused_new_run_leaves_nothing_behind(where, request, tmp_path, monkeypatch):
    """A new run refused before any worker started (a node off its lock, too few
    CPUs): its folder (in a store: its objects, and this node's working copy)
    goes, and the day's folder with it unless another run of the day is there."""
    from trainlab.run.location import RunLocation

    if where == "local":
        root = str(tmp_path / "runs")
    else:
        _, bucket = request.getfixturevalue("s3_env")
        monkeypatch.setenv("TRAINLAB_SCRATCH_DIR", str(tmp_path / "scratch"))
        root = f"s3://{bucket}/runs"
    scratch = str(tmp_path / "scratch")
    first = RunLocation.of(f"{root}/2026-12-07/first", scratch)
    other = RunLocation.of(f"{root}/2026-12-07/other", scratch)
    for loc in (first, other):
        loc.write_text("config.yaml", "name: x\n")
        loc.write_text("logs/attempts.jsonl", "")
    (first.local / "logs").mkdir(parents=True, exist_ok=True)
    launcher._remove_refused(first)
    assert not first.home.exists("config.yaml") and not first.local.exists()
    assert other.home.exists("config.yaml")  # another run of the day stays
    launcher._remove_refused(other)
    assert not other.home.exists("config.yaml")
    if where == "local":
        assert not (tmp_path / "runs" / "2026-12-07").exists()  # the day's folder, empty
