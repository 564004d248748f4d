"""Records that survive the store (issue 27): with the run's SQLite MLflow store
held by another process (`BEGIN EXCLUSIVE`) for longer than a short run, the
run's records wait in its journal, the run's end says so (summary and CLI line),
and the next command that opens the store writes them all, each metric point
once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.track.conftest import artifact_text, only_run
from trainlab.run.records import RunRecords
from trainlab.track.backend import tracking_uri
from trainlab.track.journal import JOURNAL, MARKER, Journal, flush_journal, store_busy

HOLD = (
    "import sqlite3, sys\n"
    "con = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
    "con.execute('BEGIN EXCLUSIVE')\n"
    "print('locked', flush=True)\n"
    "sys.stdin.read()\n"  # held until the test closes stdin
    "con.execute('ROLLBACK')\n"
)


@pytest.fixture
def locked_store(runs_root: Path):
    """Another process holds the store with BEGIN EXCLUSIVE; `release()` ends it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(runs_root / "mlflow.db")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"

    def release() -> None:
        if proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(10)

    yield release
    release()


def _summary(r0, status: str = "completed") -> dict:
    return {
        "name": r0.cfg.name,
        "status": status,
        "final_step": 60,
        "final_loss": 1.5,
        "val_loss": 1.8,
        "restarts": 0,
        "wall_seconds": 3.0,
        "run_dir": str(r0.run_dir),
        "last_checkpoint": str(r0.run_dir / "checkpoints/step-00000060"),
        "best_checkpoint": str(r0.run_dir / "checkpoints/step-00000060"),
    }


def test_a_locked_store_delays_the_record_and_never_loses_it(
    rank0, runs_root, client, locked_store, monkeypatch, capsys
):
    monkeypatch.setenv("TRAINLAB_STORE_RETRY_S", "0.2")
    monkeypatch.setenv("TRAINLAB_STORE_END_WAIT_S", "1")
    uri = tracking_uri(runs_root)
    assert store_busy(uri)
    t0 = time.monotonic()

    # The attack: a short run while the store is held.
    r0 = rank0()
    callbacks = r0.start()
    sent = r0.steps(1, r0.cfg.train.total_steps)
    summary = _summary(r0)
    RunRecords(r0.run_dir).write_summary(summary)  # as the loop does before on_run_end
    callbacks.on_run_end(summary)
    assert time.monotonic() - t0 < 15  # the training side never waits on the lock

    # The end says records wait: in the summary, in run_summary.json, on the CLI.
    pending = summary["records_pending"]
    assert pending > 0
    assert RunRecords(r0.run_dir).read_summary()["records_pending"] == pending
    journal = Journal(r0.run_dir)
    assert journal.path == r0.run_dir / "logs" / JOURNAL
    assert journal.pending_count() == pending
    from trainlab.cli.train_cmd import _print_done

    _print_done(summary)
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert "completed, records not all in the MLflow store" in first
    assert f"records pending: {pending}" in err
    assert f"trainlab track-flush {r0.run_dir}" in err

    # Released: the next command that opens the store writes the whole record.
    locked_store()
    from trainlab.track.query import list_runs

    rows = list_runs(uri, None, None, 20)
    assert [(r["name"], r["records_pending"]) for r in rows] == [(r0.cfg.name, 0)]
    assert journal.pending_count() == 0
    assert RunRecords(r0.run_dir).read_summary()["records_pending"] == 0

    run = only_run(client)
    assert run.info.status == "FINISHED"
    assert run.data.tags["status"] == "completed"
    assert run.data.params["train.total_steps"] == "60"
    assert run.data.tags["run_dir"] == str(r0.run_dir)
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in loss] == sorted(sent)
    assert [m.value for m in loss] == pytest.approx([sent[s]["loss"] for s in sorted(sent)])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss/all")] == [
        20,
        40,
        60,
    ]
    assert "model" in artifact_text(client, run.info.run_id, "config.yaml")
    assert json.loads(artifact_text(client, run.info.run_id, "run_summary.json"))["status"] == (
        "completed"
    )
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"loss_curve.png", "mix_shares.png", "alerts.jsonl", "plan.json"} <= arts

    # A flush interrupted before its offset was recorded replays: nothing doubles.
    (r0.run_dir / "logs" / MARKER).unlink()
    assert flush_journal(journal, client) == 0
    run = only_run(client)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == sorted(sent)
    assert time.monotonic() - t0 < 30


def test_the_run_flushes_itself_when_the_store_answers_during_the_run(
    rank0, client, locked_store, monkeypatch
):
    monkeypatch.setenv("TRAINLAB_STORE_RETRY_S", "0.2")
    r0 = rank0()
    callbacks = r0.start()
    r0.steps(1, 30)
    locked_store()  # the store answers again mid-run
    from trainlab.track.query import list_runs

    uri = tracking_uri(r0.run_dir.parents[1])
    list_runs(uri, None, None, 20)  # a command may write the live run's start first
    tracker = callbacks.callbacks[0]
    deadline = time.monotonic() + 10
    while tracker._heartbeat is None and time.monotonic() < deadline:
        tracker.log_metrics(30, {"probe": 1.0})  # a new record wakes the run's flusher
        time.sleep(0.1)
    assert tracker.flush(10) == 0 and tracker.run_id == only_run(client).info.run_id
    assert tracker._heartbeat is not None  # the run's own heartbeat runs either way
    # Records that still wait (here: their flush held up) are shown by `runs`.
    journal = Journal(r0.run_dir)
    with journal.flushing() as mine:
        assert mine
        r0.steps(31, 45)
        rows = list_runs(uri, None, None, 20)
        assert rows[0]["records_pending"] == journal.pending_count() > 0
    r0.steps(46, 60)
    summary = _summary(r0)
    callbacks.on_run_end(summary)
    assert "records_pending" not in summary
    run = only_run(client)
    assert run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert steps == list(range(5, 61, 5))


def test_track_flush_writes_a_runs_pending_records(
    rank0, runs_root, client, locked_store, monkeypatch
):
    from click.testing import CliRunner

    from trainlab.cli.track_cmd import track_flush

    monkeypatch.setenv("TRAINLAB_STORE_RETRY_S", "0.2")
    monkeypatch.setenv("TRAINLAB_STORE_END_WAIT_S", "0.5")
    r0 = rank0()
    callbacks = r0.start()
    r0.steps(1, 10)
    callbacks.on_run_end(_summary(r0, "stopped"))
    busy = CliRunner().invoke(track_flush, [str(r0.run_dir)], standalone_mode=False)
    assert busy.return_value == 1 and "locked by another process" in busy.output
    locked_store()
    done = CliRunner().invoke(track_flush, [str(r0.run_dir)], standalone_mode=False)
    assert done.return_value == 0, done.output
    run = only_run(client)
    assert run.info.status == "KILLED" and run.data.tags["status"] == "stopped"


def test_track_flush_of_no_run_names_it(tmp_path):
    """A RUN_DIR that is no run (a mistyped path) is a one-line error, on a disk as
    in a store (the same existence check)."""
    from click.testing import CliRunner

    from trainlab.cli.track_cmd import track_flush
    from trainlab.errors import UserError

    missing = tmp_path / "2026-12-07" / "tiny"
    with pytest.raises(UserError, match=f"RUN_DIR {missing}: no such run"):
        CliRunner().invoke(
            track_flush, [str(missing)], standalone_mode=False, catch_exceptions=False
        )


def test_a_start_cut_short_after_the_run_was_created_is_completed(
    rank0, runs_root, client, locked_store, monkeypatch
):
    from trainlab.track.backend import artifact_location
    from trainlab.track.mlflow_cb import experiment_name, run_key

    monkeypatch.setenv("TRAINLAB_STORE_RETRY_S", "0.2")
    monkeypatch.setenv("TRAINLAB_STORE_END_WAIT_S", "0.5")
    r0 = rank0()
    callbacks = r0.start()
    r0.steps(1, 10)
    callbacks.on_run_end(_summary(r0))
    locked_store()
    # A flush that created the run and stopped before its params and artifacts.
    exp = client.create_experiment(
        experiment_name(r0.cfg), artifact_location=artifact_location(runs_root)
    )
    client.create_run(exp, run_name=r0.run_dir.name, tags={"run_key": run_key(str(r0.run_dir))})
    assert flush_journal(Journal(r0.run_dir), client) == 0
    run = only_run(client)
    assert run.data.params["train.total_steps"] == "60"
    assert run.data.tags["config_hash"] and run.info.status == "FINISHED"
    assert "model" in artifact_text(client, run.info.run_id, "config.yaml")


def test_track_flush_of_a_run_in_object_storage(
    rank0, runs_root, client, locked_store, monkeypatch, s3_env, tmp_path
):
    """A run in object storage ships its journal with its logs; `track-flush URI`
    on another machine reads it from the store, writes the records into the
    store of the runs root named, and ships back what was written."""
    from click.testing import CliRunner

    from trainlab.cli.track_cmd import track_flush
    from trainlab.run.location import RunLocation

    monkeypatch.setenv("TRAINLAB_STORE_RETRY_S", "0.2")
    monkeypatch.setenv("TRAINLAB_STORE_END_WAIT_S", "0.5")
    monkeypatch.setenv("TRAINLAB_SCRATCH_DIR", str(tmp_path / "other-machine"))
    r0 = rank0()
    callbacks = r0.start()
    r0.steps(1, 10)
    callbacks.on_run_end(_summary(r0, "stopped"))
    _, bucket = s3_env
    loc = RunLocation.of(f"s3://{bucket}/runs/2026-12-05/{Path(r0.run_dir).name}")
    for name in (JOURNAL, MARKER):  # what the run's log shipping put in the store
        if (Path(r0.run_dir) / "logs" / name).exists():
            loc.upload(Path(r0.run_dir) / "logs" / name, f"logs/{name}")
    locked_store()
    args = [loc.uri, "--runs-root", str(runs_root)]
    done = CliRunner().invoke(track_flush, args, standalone_mode=False)
    assert done.return_value == 0, done.output
    assert only_run(client).data.tags["status"] == "stopped"
    assert loc.local.is_relative_to(tmp_path / "other-machine")
    flushed = Journal(loc.local)
    assert flushed.pending_count() == 0
    assert loc.read_text(f"logs/{MARKER}") == (loc.local / "logs" / MARKER).read_text()
