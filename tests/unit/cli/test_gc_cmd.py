"""`trainlab gc`: old runs and rehearsals go, each run's last valid and best
checkpoint stay (unless --force). Run directories are made with the training
layer's own writers (checkpoint commits, run_summary.json)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from trainlab.cli import main
from trainlab.run import checkpoints as ckpts
from trainlab.run.records import RunRecords
from trainlab.train import checkpoint as ck

DAY = 86400.0


def _checkpoint(run: Path, step: int, val_loss: float | None, valid: bool = True) -> None:
    staging = run / "checkpoints" / f"{ckpts.STAGING_PREFIX}{ckpts.dir_name(step)}"
    staging.mkdir(parents=True)
    (staging / "model.pt").write_bytes(os.urandom(4096))

    def validator(_: Path) -> ckpts.Validation:
        return ckpts.Validation(ok=valid, loss=val_loss, error=None if valid else "loss is nan")

    ck.commit(staging, run / "checkpoints" / ckpts.dir_name(step), {"step": step}, validator)


def make_run(
    root: Path,
    day: str,
    name: str,
    status: str | None,
    checkpoints: list[tuple[int, float | None, bool]] = (),
    age_days: float = 30,
    smoke: bool = False,
) -> Path:
    run = root / day / name
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text(f"name: {name}\n")
    (run / "logs" / "rank0.log").write_text("step 1\n")
    (run / "ray" / "ray-abc").mkdir(parents=True)  # Ray Train's bookkeeping
    (run / "ray" / "ray-abc" / "state.json").write_text("{}")
    for step, loss, valid in checkpoints:
        _checkpoint(run, step, loss, valid)
    if status is not None:
        summary = {"name": name, "status": status, **({"smoke": {"checks": {}}} if smoke else {})}
        RunRecords(run).write_summary(summary)
    then = time.time() - age_days * DAY
    for d, dirs, files in os.walk(run):
        for p in [d, *(os.path.join(d, x) for x in dirs + files)]:
            os.utime(p, (then, then))
    return run


def gc(capsys, *args: str) -> tuple[int, dict]:
    with pytest.raises(SystemExit) as exit_info:
        main(["gc", *args, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return exit_info.value.code, (json.loads(out[-1]) if out else {})


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    (root / "mlflow.db").write_bytes(b"records")  # never touched
    done = make_run(
        root,
        "2026-10-01",
        "tiny",
        "completed",
        [(10, 2.0, True), (20, 1.5, True), (30, 1.8, True), (40, None, False)],
    )
    failed = make_run(root, "2026-10-02", "crashy", "failed", [(5, None, False)])
    smoke = make_run(
        root, "2026-10-03", "tiny-smoke", "completed", [(3, 2.5, True), (6, 2.4, True)], smoke=True
    )
    recent = make_run(root, "2026-12-01", "fresh", "failed", [(2, 3.0, True)], age_days=1)
    return root, {"done": done, "failed": failed, "smoke": smoke, "recent": recent}


def _left(run: Path) -> set[str]:
    return {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()}


def test_gc_keeps_each_runs_last_valid_and_best_checkpoint_and_its_records(runs, capsys):
    root, r = runs
    code, report = gc(capsys, "--runs-root", str(root))
    assert code == 0
    by_dir = {Path(x["run_dir"]).name: x for x in report["runs"]}
    assert set(by_dir) == {"tiny", "crashy", "tiny-smoke"}  # "fresh" is 1 day old

    # The completed run: step 20 (best) and 30 (last valid) and the records stay.
    assert by_dir["tiny"]["action"] == "trim"
    assert by_dir["tiny"]["kept_checkpoints"] == {
        "step-00000020": "best",
        "step-00000030": "last valid",
    }
    left = _left(r["done"])
    assert {p.split("/")[1] for p in left if p.startswith("checkpoints/")} == {
        "step-00000020",
        "step-00000030",
    }
    assert {"config.yaml", "run_summary.json", "logs/rank0.log"} <= left
    assert not (r["done"] / "ray").exists()
    assert ckpts.verify(ckpts.read_info(r["done"] / "checkpoints" / "step-00000030")) is None

    # A failed run with no valid checkpoint goes whole, and its empty date folder.
    assert by_dir["crashy"]["action"] == "delete" and not r["failed"].parent.exists()
    # The rehearsal keeps its best = last valid checkpoint too (no --force).
    assert by_dir["tiny-smoke"]["kept_checkpoints"] == {"step-00000006": "last valid and best"}
    assert _left(r["recent"]) and (root / "mlflow.db").read_bytes() == b"records"
    assert report["freed_bytes"] == sum(x["freed_bytes"] for x in report["runs"]) > 4096 * 3


def test_status_filter_dry_run_and_force(runs, capsys):
    root, r = runs
    before = {k: _left(v) for k, v in r.items()}
    code, report = gc(capsys, "--runs-root", str(root), "--status", "failed,smoke", "--dry-run")
    assert code == 0 and report["dry_run"] is True
    assert {Path(x["run_dir"]).name for x in report["runs"]} == {"crashy", "tiny-smoke"}
    assert {k: _left(v) for k, v in r.items()} == before  # a dry run deletes nothing

    code, report = gc(capsys, "--runs-root", str(root), "--status", "smoke", "--force")
    assert code == 0 and [x["action"] for x in report["runs"]] == ["delete"]
    assert not r["smoke"].exists() and r["done"].exists() and r["failed"].exists()

    code, report = gc(capsys, "--runs-root", str(root), "--older-than", "2d", "--force")
    assert code == 0 and {x["action"] for x in report["runs"]} == {"delete"}
    assert not r["done"].exists() and not r["failed"].exists() and r["recent"].exists()
    code, report = gc(capsys, "--runs-root", str(root), "--older-than", "12h", "--force")
    assert code == 0 and not r["recent"].exists()
    assert sorted(p.name for p in root.iterdir()) == ["mlflow.db"]


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--older-than", "14 days", "--older-than '14 days': expected a duration"),
        ("--status", "failed,old", "--status 'failed,old': unknown old"),
    ],
)
def test_bad_flags_exit_2_with_one_line(runs, capsys, flag, value, message):
    root, _ = runs
    with pytest.raises(SystemExit) as exit_info:
        main(["gc", "--runs-root", str(root), flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err == [f"error: {err[0][7:]}"]
    assert message in err[0]


def test_a_passed_rehearsal_is_removed_and_a_failed_one_kept(tmp_path):
    """`trainlab train --smoke` cleans up after itself when the rehearsal passed
    (trainlab.cli.train_cmd.clean_up_rehearsal; --keep-smoke skips it)."""
    from trainlab.cli.train_cmd import clean_up_rehearsal

    root = tmp_path / "runs"
    ok = make_run(root, "2026-12-04", "tiny-smoke", "completed", [(3, 2.0, True)], smoke=True)
    bad = make_run(root, "2026-12-04", "tiny-smoke-2", "failed", [(3, 2.0, True)], smoke=True)
    checks = {"completed": True, "resumed_from_checkpoint": True}
    passed = {"status": "completed", "run_dir": str(ok), "smoke": {"checks": checks}}
    failed = {
        "status": "failed",
        "run_dir": str(bad),
        "smoke": {"checks": {**checks, "resumed_from_checkpoint": False}},
    }
    assert clean_up_rehearsal(failed)["run_dir_removed"] is False and _left(bad)
    assert clean_up_rehearsal(passed)["run_dir_removed"] is True
    assert not ok.exists() and bad.exists()
    # Not a rehearsal's summary (no smoke checks): never removed.
    real = make_run(root, "2026-12-04", "tiny", "completed", [(3, 2.0, True)])
    summary = {"status": "completed", "run_dir": str(real)}
    assert clean_up_rehearsal(summary)["run_dir_removed"] is False and real.exists()


# --------------------------------------------------------------------------- live runs
# A run whose lock a live process holds (trainlab.run.lock) is never touched,
# whatever its age, status or --force; the holders below are real processes.


def test_a_live_run_survives_gc_force_and_is_collected_once_its_holder_ends(tmp_path, capsys):
    from tests.unit.train.test_run_lock import hold

    root = tmp_path / "runs"
    # old files, and a summary from an earlier attempt: only the lock says it is live
    live = make_run(root, "2026-10-01", "conc", "failed", [(10, 2.0, True), (20, 1.9, True)])
    proc = hold(live)
    try:
        before = _left(live)
        code, report = gc(capsys, "--runs-root", str(root), "--older-than", "0", "--force")
        assert code == 0 and report["runs"] == [] and report["freed_bytes"] == 0
        (skipped,) = report["skipped"]
        assert skipped["run"] == str(live)
        assert skipped["reason"].startswith(f"live (pid {proc.pid} on host ")
        assert _left(live) == before

        with pytest.raises(SystemExit):
            main(["gc", "--runs-root", str(root), "--older-than", "0", "--force"])
        out = capsys.readouterr().out
        assert f"skip 2026-10-01/conc: live (pid {proc.pid} on host " in out
        assert "0 run(s); freed 0 B" in out and live.exists()
    finally:
        proc.kill()
        proc.wait(timeout=10)
    code, report = gc(capsys, "--runs-root", str(root), "--older-than", "0", "--force")
    assert code == 0 and report["skipped"] == []
    assert [x["run_dir"] for x in report["runs"]] == [str(live)] and not live.exists()


def test_a_run_that_comes_alive_after_planning_is_left_alone(tmp_path):
    from tests.unit.train.test_run_lock import hold
    from trainlab.cli import gc_cmd
    from trainlab.location import local

    root = tmp_path / "runs"
    run = make_run(root, "2026-10-01", "late", "completed", [(10, 2.0, True)])
    found = gc_cmd.find_runs(local(root))
    actions, skipped = gc_cmd.plan_gc(found, 0, set(gc_cmd.STATUSES), True)
    assert [a.run.uri for a in actions] == [str(run)] and skipped == []
    proc = hold(run)  # a resume starts between gc's reading and its deleting
    try:
        (late,) = gc_cmd.apply(actions)
        assert late.run.uri == str(run) and f"pid {proc.pid}" in late.reason
        assert (run / "checkpoints" / "step-00000010" / "model.pt").exists()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_fresh_holder_on_another_host_is_skipped_a_silent_one_is_not(tmp_path, capsys):
    from trainlab.run import lock as run_lock

    root = tmp_path / "runs"
    fresh = make_run(root, "2026-10-01", "remote", "completed", [(10, 2.0, True)])
    silent = make_run(root, "2026-10-01", "gone", "completed", [(10, 2.0, True)])
    now = time.time()
    for run, beat in ((fresh, now), (silent, now - 3 * DAY)):
        record = {"host": "elsewhere", "pid": 7, "since": now - DAY, "beat": beat}
        (run / run_lock.HOLDER).write_text(json.dumps(record))
    code, report = gc(capsys, "--runs-root", str(root), "--older-than", "0", "--force")
    assert code == 0
    assert [(s["run"], s["reason"][:31]) for s in report["skipped"]] == [
        (str(fresh), "live (pid 7 on host elsewhere s")
    ]
    assert fresh.exists() and not silent.exists()


def test_a_trimmed_run_keeps_its_lock_file(tmp_path, capsys):
    from trainlab.run.lock import LOCK, RunLock

    root = tmp_path / "runs"
    run = make_run(root, "2026-10-01", "tiny", "completed", [(10, 2.0, True), (20, 1.5, True)])
    RunLock.acquire(run).release()  # a run that was trained and ended
    code, report = gc(capsys, "--runs-root", str(root), "--older-than", "0")
    assert code == 0 and report["runs"][0]["action"] == "trim"
    assert (run / LOCK).exists() and not (run / "ray").exists()


def test_a_missing_runs_root_is_one_line_and_links_are_never_followed(tmp_path, capsys):
    """A mistyped --runs-root is an error, not "0 runs"; a runs root's symbolic
    links (a date folder, a run, a run's checkpoints) are neither read nor
    deleted through: what they point to survives gc --force."""
    with pytest.raises(SystemExit) as exit_info:
        main(["gc", "--runs-root", str(tmp_path / "nope")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert f"--runs-root {tmp_path / 'nope'}: no such directory or prefix" in err[0]

    root, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    outside = make_run(elsewhere, "2026-10-01", "precious", "failed", [(10, 2.0, True)])
    (root / "2026-10-02").mkdir(parents=True)
    (root / "2026-10-01").symlink_to(elsewhere / "2026-10-01")  # a linked date
    (root / "2026-10-02" / "linked").symlink_to(outside)  # a linked run
    run = make_run(root, "2026-10-03", "tiny", "failed", [(10, 2.0, True), (20, 1.0, True)])
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(outside / "checkpoints")  # linked checkpoints
    before = _left(outside)
    code, report = gc(capsys, "--runs-root", str(root), "--older-than", "0", "--force")
    assert code == 0 and [x["run_dir"] for x in report["runs"]] == [str(run)]
    assert not run.exists() and _left(outside) == before
    assert (root / "2026-10-01").is_symlink() and (root / "2026-10-02" / "linked").is_symlink()
