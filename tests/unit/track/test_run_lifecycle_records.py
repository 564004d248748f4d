"""Records of a run's life kept true from outside its processes, on a real
MLflow store through the real callbacks: heartbeats and `lost` runs, `trainlab
stop`'s `stopped`, active vs wall time, and model-training experiments."""

from __future__ import annotations

import json
import time

import pytest

from tests.unit.track.conftest import artifact_text, only_run
from trainlab.config import to_yaml
from trainlab.run.records import RunRecords
from trainlab.track import tracking_uri
from trainlab.track.backend import EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND
from trainlab.track.heartbeat import correct_lost
from trainlab.track.lifecycle import end_run
from trainlab.track.mlflow_cb import experiment_name
from trainlab.track.query import list_runs


@pytest.fixture(autouse=True)
def slow_heartbeat(monkeypatch):
    """One beat at the start and at the end; none in between during a test."""
    monkeypatch.setenv("TRAINLAB_HEARTBEAT_S", "3600")


def started(rank0):
    run = rank0()
    (run.run_dir / "config.yaml").write_text(to_yaml(run.cfg))
    run.start()
    run.steps(1, 10)
    run.callbacks.callbacks[0].flush()
    (run.run_dir / "logs").mkdir(exist_ok=True)
    RunRecords(run.run_dir).write_progress(10)  # as rank 0's agent does
    return run


def test_experiments_are_model_training_experiments(rank0, client):
    run = started(rank0)
    exp = client.get_experiment_by_name(experiment_name(run.cfg))
    assert exp.tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND


def test_a_run_without_heartbeat_is_listed_lost_and_its_records_corrected(
    rank0, client, runs_root, monkeypatch
):
    run = started(rank0)
    mlrun = only_run(client)
    assert mlrun.info.status == "RUNNING" and float(mlrun.data.tags["heartbeat"]) > 0
    assert list_runs(tracking_uri(runs_root))[0]["status"] == "running"
    # Its processes vanish: the last beat ages past the limit.
    client.set_tag(mlrun.info.run_id, "heartbeat", f"{time.time() - 600:.0f}")
    monkeypatch.setenv("TRAINLAB_LOST_AFTER_S", "120")
    (row,) = list_runs(tracking_uri(runs_root))
    assert row["status"] == "lost" and row["active_s"] >= 0
    mlrun = only_run(client)
    assert (mlrun.info.status, mlrun.data.tags["status"]) == ("FAILED", "lost")
    summary = json.loads((run.run_dir / "run_summary.json").read_text())
    assert summary["status"] == "lost" and summary["stop_reason"].startswith("lost: no heartbeat")
    assert summary["final_step"] == 10  # rank 0's last logged step (logs/progress.json)


def test_the_next_command_that_opens_the_store_ends_a_lost_run(
    rank0, client, runs_root, monkeypatch
):
    """Not only `runs`/`compare`: any command opening the store (here a new run's
    MLflow record starting, as `trainlab train` does) ends a lost run's records,
    and leaves running ones alone."""
    lost = started(rank0)
    old = only_run(client)
    client.set_tag(old.info.run_id, "heartbeat", f"{time.time() - 600:.0f}")
    monkeypatch.setenv("TRAINLAB_LOST_AFTER_S", "120")
    other = rank0("name=other")
    other.start()
    experiments = [e.experiment_id for e in client.search_experiments()]
    after = {r.info.run_name: r for r in client.search_runs(experiments)}
    assert (after["tiny"].info.status, after["tiny"].data.tags["status"]) == ("FAILED", "lost")
    assert after["other"].info.status == "RUNNING"
    summary = json.loads((lost.run_dir / "run_summary.json").read_text())
    assert summary["status"] == "lost" and summary["final_step"] == 10
    logged = json.loads(artifact_text(client, old.info.run_id, "run_summary.json"))
    assert logged["status"] == "lost"
    # Opened again: nothing left to correct, the records stay as they are.
    before = (lost.run_dir / "run_summary.json").read_bytes()
    assert correct_lost(client) == []
    assert (lost.run_dir / "run_summary.json").read_bytes() == before


def test_a_stopped_jobs_run_is_marked_stopped_once(rank0, client):
    """What `trainlab stop JOB` does after Ray killed the job's processes."""
    run = started(rank0)
    summary = end_run(run.run_dir, "stopped", "stopped by trainlab stop job-1")
    assert summary["status"] == "stopped" and summary["stop_reason"].endswith("job-1")
    mlrun = only_run(client)
    assert (mlrun.info.status, mlrun.data.tags["status"]) == ("KILLED", "stopped")
    before = (run.run_dir / "run_summary.json").read_bytes()
    assert end_run(run.run_dir, "stopped", "again") is None  # already ended: untouched
    assert (run.run_dir / "run_summary.json").read_bytes() == before


def test_stop_of_a_job_that_had_ended_says_how_its_run_ended(rank0, client):
    """`trainlab stop` on a job whose driver was already gone (killed, its node
    lost): nothing to stop; the run, which nothing ended, is recorded `lost` (what
    `runs` would call it) and said so, with what a resume keeps; a run its own
    processes ended is left as it is and said as it ended."""
    import types

    from trainlab.cli.jobs_cmd import _end_stopped_run, stopped_line
    from trainlab.runstatus import RunStatus

    run = started(rank0)
    info = types.SimpleNamespace(metadata={"trainlab_run_dir": str(run.run_dir)})
    gone = _end_stopped_run(info, "job-1", RunStatus.LOST, "its job job-1 had ended (FAILED)")
    assert gone["status"] == "lost" and gone["final_step"] == 10
    assert (only_run(client).info.status, only_run(client).data.tags["status"]) == (
        "FAILED",
        "lost",
    )
    line = stopped_line(gone, already_ended=True)
    assert "ended before the stop (lost) at step 10; no checkpoint was kept" in line
    # Asked again: the record stands (not rewritten), and is said the same way.
    before = (run.run_dir / "run_summary.json").read_bytes()
    again = _end_stopped_run(info, "job-1", RunStatus.LOST, "again")
    assert again["status"] == "lost" and (run.run_dir / "run_summary.json").read_bytes() == before


def test_active_time_excludes_the_idle_time_between_starts(rank0, client, runs_root):
    run = started(rank0)
    run.end("interrupted")
    first = float(only_run(client).data.tags["active_seconds"])
    time.sleep(1.5)  # idle between the interrupt and the resume
    run.start(start_step=10, restarts=0)
    run.steps(11, 20)
    run.end("completed")
    (row,) = list_runs(tracking_uri(runs_root))
    assert row["active_s"] is not None and row["active_s"] >= first
    assert row["duration_s"] - row["active_s"] >= 1.0


def test_a_run_failed_by_its_disk_says_the_cause_in_the_store(rank0, client):
    """A storage fault's summary (trainlab.train.loop.trainer `_fault`) through rank 0's
    on_run_end: the MLflow run FAILED, with the same cause as run_summary.json."""
    cause = "no space left on device while saving step 20; newest valid checkpoint step 10"
    run = started(rank0)
    run.end("failed", error=cause, failure_cause="storage")
    mlrun = only_run(client)
    assert mlrun.info.status == "FAILED"
    assert mlrun.data.tags["status"] == "failed" and mlrun.data.tags["error"] == cause
    summary = json.loads(artifact_text(client, mlrun.info.run_id, "run_summary.json"))
    assert summary["error"] == cause and summary["failure_cause"] == "storage"
