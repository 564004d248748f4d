"""`trainlab train` on an existing run, as a user types it: CONFIG --resume or the
run directory itself (`trainlab train RUN_DIR --resume`, its config.yaml with
--set on top), a completed run left byte-identical (exit 0), a different
experiment refused with the differing keys (exit 2, one line), --extend.
The runs are real; only Ray Train's part (`launcher._fit`) runs in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.train_helpers import dataset_dir, local_loader, tiny_config
from tests.unit.train.test_rundir_lifecycle import STEPS, must_not_train, snapshot
from trainlab.cli import cli, main
from trainlab.config import to_yaml
from trainlab.errors import UserError
from trainlab.train.driver import launcher
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv


def fit_in_process(cfg, job):
    return Trainer(job, local_loader(job), DistEnv()).fit()


def train(*args: str) -> tuple[object, str, str]:
    """(return value or exception, stdout, stderr) of `trainlab train ARGS`."""
    res = CliRunner().invoke(cli, ["train", *args], standalone_mode=False)
    return (res.exception or res.return_value), res.stdout, res.stderr


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(config file, run directory) of a completed 4-step run made by `trainlab train`."""
    base = tmp_path_factory.mktemp("cli-resume")
    cfg = tiny_config(
        dataset_dir(tmp_path_factory), train={**STEPS, "runs_root": str(base / "runs")}
    )
    config = base / "unit.yaml"
    config.write_text(to_yaml(cfg))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launcher, "_fit", fit_in_process)
        rv, out, _ = train(str(config), "--json")
    assert rv == 0, rv
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["status"] == "completed"
    return config, Path(summary["run_dir"])


def test_resuming_a_completed_run_says_so_and_leaves_it_alone(run, monkeypatch):
    config, run_dir = run
    monkeypatch.setattr(launcher, "_fit", must_not_train)
    before = snapshot(run_dir)
    relayout = ["--set", "parallel.tp=2", "--set", "parallel.dp=1"]
    outs = []
    for args in (
        [str(config), "--resume"],
        [str(config), "--run-dir", str(run_dir)],
        [str(run_dir), "--resume", "--json"],
        # the layout is not the experiment's identity: still the same run
        [str(run_dir), "--resume", *relayout, "--set", "resource.num_workers=2"],
    ):
        rv, out, err = train(*args)
        assert rv == 0, (args, rv)
        assert "unit: already completed at step 4 of 4; nothing to do" in err
        assert f"trainlab train {run_dir} --resume --extend" in err
        outs.append(out)
    assert json.loads(outs[2].strip().splitlines()[-1])["already_complete"] is True
    assert snapshot(run_dir) == before


def test_a_different_experiment_is_refused_with_its_differing_keys(run, monkeypatch, capsys):
    _, run_dir = run
    monkeypatch.setattr(launcher, "_fit", must_not_train)
    before = snapshot(run_dir)
    with pytest.raises(SystemExit) as e:
        main(["train", str(run_dir), "--resume", "--set", "train.lr=1e-4", "--set", "train.seed=7"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "holds a different experiment (config hash" in err
    assert "train.seed: 0 in the run, 7 now" in err and "train.lr: 0.003 in the run, 0.0001 now" in err
    assert "Traceback" not in err
    assert snapshot(run_dir) == before


def test_run_dir_as_config_needs_resume_and_extend_needs_a_run(run):
    config, run_dir = run
    rv, _, _ = train(str(run_dir))
    assert isinstance(rv, UserError) and "is a run" in str(rv) and "--resume" in str(rv)
    rv, _, _ = train(str(config.parent), "--resume")
    assert isinstance(rv, UserError) and "no config.yaml" in str(rv)
    rv, _, _ = train(str(config), "--extend", "--set", "train.total_steps=6")
    assert isinstance(rv, UserError) and "--extend continues an existing run" in str(rv)


def test_run_dir_resume_with_set_extends_the_run(run, monkeypatch):
    _, run_dir = run
    monkeypatch.setattr(launcher, "_fit", fit_in_process)
    rv, out, _ = train(
        str(run_dir), "--resume", "--extend", "--set", "train.total_steps=6", "--json"
    )
    assert rv == 0, rv
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["final_step"] == 6 and summary["start_step"] == 4
    assert summary["extensions"][0]["changed"] == {"train.total_steps": [4, 6]}


def test_a_run_held_by_a_live_process_is_refused_in_one_line(run, monkeypatch, capsys):
    from tests.unit.train.test_run_lock import hold

    _, run_dir = run
    monkeypatch.setattr(launcher, "_fit", must_not_train)
    proc = hold(run_dir)  # another driver of this run, alive
    try:
        before = snapshot(run_dir)
        with pytest.raises(SystemExit) as e:
            main(["train", str(run_dir), "--resume", "--extend", "--set", "train.total_steps=8"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"in use by another trainlab process (pid {proc.pid} on host " in err
        assert snapshot(run_dir) == before
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_the_driver_holds_the_lock_while_it_trains(run, monkeypatch):
    import os

    from trainlab.run import lock as run_lock

    _, run_dir = run
    seen = []

    def fit_checking_the_lock(cfg, job):
        seen.append(run_lock.live_holder(job.run_dir))
        return fit_in_process(cfg, job)

    monkeypatch.setattr(launcher, "_fit", fit_checking_the_lock)
    rv, _, _ = train(str(run_dir), "--resume", "--extend", "--set", "train.total_steps=8")
    assert rv == 0, rv
    assert seen and seen[0].startswith(f"pid {os.getpid()} on host ")
    assert run_lock.live_holder(run_dir) is None  # released when the run ended
    assert run_lock.read_holder(run_dir) is None


def test_a_run_whose_checkpoints_are_all_refused_is_not_restarted_from_zero(
    tmp_path_factory, monkeypatch, capsys
):
    from trainlab.run import checkpoints as ckpts

    base = tmp_path_factory.mktemp("all-refused")
    cfg = tiny_config(
        dataset_dir(tmp_path_factory),
        train={**STEPS, "runs_root": str(base / "runs"), "checkpoint": {"every_steps": 2}},
    )
    config = base / "unit.yaml"
    config.write_text(to_yaml(cfg))
    monkeypatch.setattr(launcher, "_fit", fit_in_process)
    rv, out, _ = train(str(config), "--json")
    assert rv == 0, rv
    run_dir = Path(json.loads(out.strip().splitlines()[-1])["run_dir"])
    two, four = (run_dir / "checkpoints" / ckpts.dir_name(s) for s in (2, 4))
    # step 4 corrupted on disk, step 2 marked invalid by its validation
    payload = next(p for p in sorted(four.rglob("*")) if p.is_file() and p.suffix == ".pt")
    payload.write_bytes(b"corrupted" + payload.read_bytes()[9:])
    meta = json.loads((two / ckpts.META_FILE).read_text())
    (two / ckpts.META_FILE).write_text(json.dumps({**meta, "valid": False, "error": "loss is nan"}))

    def state() -> dict:
        # Not logs/driver.log: in one process the "trainlab" logger keeps every earlier
        # run's driver.log handler, which the refusal's warnings then reach (a CLI
        # process trains one run and attaches its handler only after the checks).
        return {k: v for k, v in snapshot(run_dir).items() if k != "logs/driver.log"}

    monkeypatch.setattr(launcher, "_fit", must_not_train)
    before = state()
    with pytest.raises(SystemExit) as e:
        main(["train", str(run_dir), "--resume", "--extend", "--set", "train.total_steps=6"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "no checkpoint to resume from, every one is refused" in err
    assert f"step-00000004 ({payload.relative_to(four)} does not match its sha256" in err
    assert "step-00000002 (not valid: loss is nan)" in err
    assert f"trainlab train {run_dir / 'config.yaml'} without --resume/--run-dir" in err
    assert state() == before

    # What it says to do starts over in a new run directory, the old one left as it is.
    monkeypatch.setattr(launcher, "_fit", fit_in_process)
    rv, out, _ = train(str(run_dir / "config.yaml"), "--json")
    assert rv == 0, rv
    fresh = Path(json.loads(out.strip().splitlines()[-1])["run_dir"])
    assert fresh != run_dir and fresh.name == f"{run_dir.name}-2"
    assert state() == before


def test_resume_with_the_same_set_flags_finds_the_run_they_named(run, monkeypatch):
    """`train CONFIG --set train.lr=1e-3` runs as `unit_lr-1e-3`; the same command with
    --resume finds that run (it was refused as a different experiment before)."""
    config, _ = run
    monkeypatch.setattr(launcher, "_fit", fit_in_process)
    flags = ["--set", "train.lr=1e-3"]
    rv, out, _ = train(str(config), *flags, "--json")
    assert rv == 0, rv
    made = Path(json.loads(out.strip().splitlines()[-1])["run_dir"])
    assert made.name == "unit_lr-1e-3"
    monkeypatch.setattr(launcher, "_fit", must_not_train)
    rv, _, err = train(str(config), *flags, "--resume")
    assert rv == 0, rv
    assert "unit_lr-1e-3: already completed at step 4 of 4" in err


def test_a_run_dir_that_does_not_exist_is_refused_unless_create(run, monkeypatch, capsys):
    """`--run-dir` continues exactly that run: a mistyped path used to start a new
    run there (outside the runs root, named after the folder). It is refused in one
    line, nothing created; `--create` asks for the new run (what `trainlab submit`
    passes, and a retry of the job, the same command, continues it)."""
    config, run_dir = run
    typo = run_dir.parent / f"{run_dir.name}-typo"
    monkeypatch.setattr(launcher, "_fit", must_not_train)
    with pytest.raises(SystemExit) as e:
        main(["train", str(config), "--run-dir", str(typo)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--run-dir {typo}: no such run directory; to start a new run there add --create" in err
    assert not typo.exists()
    with pytest.raises(SystemExit) as e:
        main(["train", str(config), "--create"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--create starts a new run in --run-dir DIR" in err

    monkeypatch.setattr(launcher, "_fit", fit_in_process)
    for _ in range(2):  # new, then continued (completed: left as it is) with the same flags
        rv, out, _ = train(str(config), "--run-dir", str(typo), "--create", "--json")
        assert rv == 0, rv
        assert json.loads(out.strip().splitlines()[-1])["run_dir"] == str(typo)
    assert json.loads(out.strip().splitlines()[-1])["already_complete"] is True
    # The directory exists now: --run-dir alone continues it.
    monkeypatch.setattr(launcher, "_fit", must_not_train)
    rv, _, _ = train(str(config), "--run-dir", str(typo))
    assert rv == 0, rv
