"""What `trainlab train` prints at the end names what it used and points at
nothing deleted: the run directory's own name (`tiny-2` when `tiny` was taken),
no checkpoint path of a removed rehearsal, and for an early Ctrl-C what the run
keeps and what it drops."""

from __future__ import annotations

import json

from trainlab.cli import train_cmd


def printed(capsys, fn, *args) -> str:
    capsys.readouterr()
    fn(*args)
    return capsys.readouterr().err


def summary(run_dir, **kw):
    return {
        "name": "tiny_steps-20",
        "status": "completed",
        "final_step": 20,
        "final_loss": 7.1,
        "val_loss": 7.0,
        "restarts": 0,
        "wall_seconds": 87.0,
        "run_dir": str(run_dir),
        "last_checkpoint": f"{run_dir}/checkpoints/step-00000020",
        "best_checkpoint": f"{run_dir}/checkpoints/step-00000020",
        **kw,
    }


def test_the_summary_names_the_directory_it_used(tmp_path, capsys):
    second = tmp_path / "2026-12-05" / "tiny_steps-20-2"
    text = printed(capsys, train_cmd._print_done, summary(second))
    assert text.startswith("tiny_steps-20-2: completed at step 20"), text
    assert train_cmd.run_label({"name": "x", "run_dir": "s3://b/runs/2026-12-05/x-3"}) == "x-3"


def test_a_removed_rehearsal_prints_no_path_inside_it(tmp_path, capsys):
    run_dir = tmp_path / "2026-12-05" / "tiny-smoke"
    (run_dir / "checkpoints" / "step-00000006").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("name: tiny-smoke\n")
    checks = {"completed": True, "resumed_from_checkpoint": True}
    done = train_cmd.clean_up_rehearsal(
        summary(run_dir, name="tiny-smoke", final_step=6, smoke={"checks": checks})
    )
    assert done["run_dir_removed"] and not run_dir.exists()
    text = printed(capsys, train_cmd._print_done, done)
    paths = [w for w in text.split() if w.startswith(str(tmp_path))]
    assert all(p.rstrip(")") == str(run_dir) for p in paths), text  # the run dir, said removed
    assert "removed" in text and "checkpoints:     removed with the run directory" in text
    assert str(run_dir) not in json.dumps(
        {k: done[k] for k in ("last_checkpoint", "best_checkpoint")}
    )


def test_an_early_ctrl_c_says_what_it_keeps_and_what_it_drops(tmp_path, capsys):
    run_dir = tmp_path / "2026-12-05" / "tiny"
    text = printed(
        capsys,
        train_cmd._print_interrupted,
        summary(
            run_dir,
            status="interrupted",
            final_step=14,
            resume_step=8,
            dropped_steps=[9, 14],
            last_checkpoint=f"{run_dir}/checkpoints/step-00000008",
        ),
    )
    assert "tiny: interrupted at step 14" in text
    assert f"kept:            step 8 ({run_dir}/checkpoints/step-00000008)" in text
    assert "dropped:         steps 9-14" in text and "on_interrupt_min_age_s" in text
    assert f"resume with:     trainlab train {run_dir} --resume" in text
    nothing = printed(
        capsys,
        train_cmd._print_interrupted,
        summary(run_dir, status="interrupted", final_step=0, last_checkpoint=None),
    )
    assert "kept:            nothing yet" in nothing and "dropped" not in nothing


def test_a_removed_rehearsal_leaves_no_record_beside_the_real_runs(tmp_path, monkeypatch):
    """A passed smoke rehearsal's MLflow run goes with its directory (it used to be
    listed `completed` by `runs` and compared with the real run); the real run's
    record stays."""
    from trainlab.track.backend import client_for, tracking_uri
    from trainlab.track.journal import run_key

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs_root = tmp_path / "runs"
    smoke_dir, real_dir = runs_root / "2026-12-05" / "tiny-smoke", runs_root / "2026-12-05" / "tiny"
    client = client_for(tracking_uri(runs_root), flush_records=False)
    exp = client.create_experiment("tiny")
    ids = {}
    for d in (smoke_dir, real_dir):
        (d / "checkpoints").mkdir(parents=True)
        (d / "config.yaml").write_text(f"name: {d.name}\n")
        ids[d.name] = client.create_run(exp, tags={"run_key": run_key(str(d))}).info.run_id
    checks = {"completed": True, "resumed_from_checkpoint": True}
    done = train_cmd.clean_up_rehearsal(
        summary(smoke_dir, name="tiny-smoke", final_step=6, smoke={"checks": checks})
    )
    assert done["run_dir_removed"]
    assert client.get_run(ids["tiny-smoke"]).info.lifecycle_stage == "deleted"
    assert client.get_run(ids["tiny"]).info.lifecycle_stage == "active"
    assert [r.info.run_id for r in client.search_runs([exp])] == [ids["tiny"]]


def test_trainlab_stop_says_what_a_resume_keeps():
    """`trainlab stop` used to print "marked stopped at step 20" with no checkpoint
    behind it; a resume then started at step 0 without a word."""
    from trainlab.cli.jobs_cmd import stopped_line

    none = stopped_line({"run_dir": "/r/tiny", "final_step": 20, "last_checkpoint": None})
    assert "marked stopped at step 20; no checkpoint was kept: a resume starts at step 0" in none
    some = stopped_line(
        {"run_dir": "/r/tiny", "final_step": 27, "last_checkpoint": "/r/tiny/checkpoints/step-00000020"}
    )
    assert "kept: its checkpoint at step 20, steps 21-27 are dropped" in some
    assert some.endswith("resume with: trainlab train /r/tiny --resume")
    # A run whose driver took the stop (SIGTERM: the next step, a checkpoint when
    # due) ended itself `interrupted`; stop said nothing of it at all.
    took = stopped_line(
        {
            "run_dir": "/r/tiny",
            "status": "interrupted",
            "final_step": 74,
            "last_checkpoint": "/r/tiny/checkpoints/step-00000060",
        }
    )
    assert "ended by its own processes (interrupted: they took the stop) at step 74" in took
    assert "kept: its checkpoint at step 60, steps 61-74 are dropped" in took


def test_trainlab_stop_of_a_run_that_took_the_stop_says_what_it_kept(tmp_path):
    """The driver of a submitted run takes Ray's SIGTERM as a graceful stop and ends
    its run `interrupted` before `trainlab stop` looks: that summary is left as it
    is (not overwritten `stopped`) and said, where stop printed nothing of the run."""
    import types

    from tests.train_helpers import tiny_config
    from trainlab.cli.jobs_cmd import _end_stopped_run, stopped_line
    from trainlab.config import to_yaml
    from trainlab.run.records import RunRecords

    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    cfg = tiny_config(tmp_path / "ds")  # read back only: no dataset needed
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    took = {"status": "interrupted", "final_step": 74, "last_checkpoint": None}
    RunRecords(run_dir).write_summary({**took, "run_dir": str(run_dir)})
    info = types.SimpleNamespace(metadata={"trainlab_run_dir": str(run_dir)})
    run = _end_stopped_run(info, "job-1")
    assert run["status"] == "interrupted" and run["final_step"] == 74
    assert RunRecords(run_dir).read_summary()["status"] == "interrupted"  # left as it was
    assert "ended by its own processes (interrupted" in stopped_line(run)
