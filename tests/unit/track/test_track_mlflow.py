"""The MLflow record of a training run, against a real SQLite store: one run per
training run, params and tags, artifacts, and the same run continued after a
restart with every metric's steps strictly increasing."""

from __future__ import annotations

import json
import pickle
import time

import pytest

from tests.unit.track.conftest import artifact_text, only_run
from trainlab.config import flatten, load_config
from trainlab.track import close_run, default_callbacks
from trainlab.track.gitinfo import git_info
from trainlab.train.loop.callbacks import CallbackList


def _steps(client, run_id, key):
    return [m.step for m in client.get_metric_history(run_id, key)]


def _artifacts(client, run_id, path=None):
    return {a.path for a in client.list_artifacts(run_id, path)}


def test_new_run_has_flattened_params_and_the_record_tags(rank0, client, monkeypatch):
    monkeypatch.setenv("TRAINLAB_GIT_COMMIT", "0123abc")
    monkeypatch.setenv("TRAINLAB_GIT_DIRTY", "true")
    r0 = rank0("train.lr=0.002", "tracking.experiment=mixes")
    r0.start(ray_job_id="raysubmit_42")

    run = only_run(client)
    assert run.info.run_name == "tiny"
    assert client.get_experiment(run.info.experiment_id).name == "mixes"
    params = run.data.params
    expected = flatten(r0.cfg.model_dump(mode="json"))
    assert set(expected) <= set(params)
    assert params["train.lr"] == "0.002"
    assert params["data.mix.code"] == "0.5"
    assert params["model.arch"] == "llama"
    assert params["train.chaos.kill_at_steps"] == "[]"
    for headline in (
        "plan.num_params",
        "plan.strategy",
        "plan.dp",
        "plan.memory_per_device_gb",
        "plan.flops_per_token",
        "plan.tokens_per_step",
    ):
        assert headline in params
    tags = run.data.tags
    assert tags["git_commit"] == "0123abc" and tags["git_dirty"] == "true"
    assert tags["config_hash"] == r0.context().config_hash
    assert tags["dataset_fingerprint"] == "f00d"
    assert tags["purpose"] == r0.cfg.purpose.strip() and tags["purpose"]
    assert tags["expectation"] == r0.cfg.expectation.strip()
    assert tags["owner"] == "trainlab"
    assert tags["ray_job_id"] == "raysubmit_42"
    assert tags["status"] == "running"
    assert run.info.status == "RUNNING"


def test_start_artifacts_describe_the_run(rank0, client):
    r0 = rank0()
    r0.start()
    run_id = only_run(client).info.run_id
    assert {"config.yaml", "plan.json", "data"} <= _artifacts(client, run_id)
    config_path = r0.run_dir / "roundtrip.yaml"
    config_path.write_text(artifact_text(client, run_id, "config.yaml"))
    assert load_config(config_path) == r0.cfg  # the resolved config, complete
    plan = json.loads(artifact_text(client, run_id, "plan.json"))
    assert plan["num_params"] == int(only_run(client).data.params["plan.num_params"])
    assert json.loads(artifact_text(client, run_id, "data/tiny-manifest.json")) == {
        "format_version": 1,
        "fingerprint": "f00d",
    }


@pytest.mark.parametrize("in_place", [False, True], ids=["new-process", "in-place"])
def test_restart_continues_the_same_run_with_strictly_increasing_steps(rank0, client, in_place):
    r0 = rank0("tracking.system_metrics=true")
    r0.start()
    first = r0.steps(1, 45)  # crash after step 45; the newest checkpoint is step 40 ...
    r0.start(start_step=20, restarts=1, in_place=in_place)  # ... say 20: 21-45 are redone
    r0.steps(21, 60, seed=1)
    r0.end()

    run = only_run(client)  # still exactly one MLflow run
    run_id = run.info.run_id
    for key in (
        "loss",
        "grad_norm",
        "tokens_per_s",
        "share/code",
        "val_loss/all",
        "val_loss/code",
        "progress",
    ):
        steps = _steps(client, run_id, key)
        assert steps == sorted(set(steps)), (key, steps)  # strictly increasing
    assert _steps(client, run_id, "loss") == list(range(5, 61, 5))
    assert _steps(client, run_id, "val_loss/all") == [20, 40, 60]
    # The points of redone steps are the ones logged first.
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert loss[25] == first[25]["loss"]
    assert run.data.tags["restarts"] == "1"
    assert run.data.tags["status"] == "completed"
    assert run.info.status == "FINISHED"


def test_end_artifacts_and_checkpoint_references(rank0, client):
    r0 = rank0()
    r0.full_run()
    run = only_run(client)
    run_id = run.info.run_id
    assert {
        "config.yaml",
        "plan.json",
        "data",
        "run_summary.json",
        "loss_curve.png",
        "mix_shares.png",
        "alerts.jsonl",
    } <= _artifacts(client, run_id)
    for png in ("loss_curve.png", "mix_shares.png"):
        with open(client.download_artifacts(run_id, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(artifact_text(client, run_id, "run_summary.json"))
    assert summary == {"name": "tiny", "status": "completed"}
    # Checkpoints are referenced by path, not copied.
    assert run.data.tags["checkpoint.latest"].endswith("checkpoints/step-00000060")
    assert run.data.tags["checkpoint.best"].endswith("checkpoints/step-00000060")
    assert "checkpoints" not in _artifacts(client, run_id)


def test_log_checkpoints_copies_valid_checkpoints(rank0, client):
    r0 = rank0("tracking.log_checkpoints=true")
    ckpt = r0.run_dir / "checkpoints" / "step-00000020"
    ckpt.mkdir(parents=True)
    (ckpt / "model.pt").write_bytes(b"weights")
    callbacks = r0.start()
    callbacks.on_checkpoint(20, str(ckpt), True, 3.0)
    callbacks.callbacks[0].flush()  # artifacts reach the store from the run's journal
    run_id = only_run(client).info.run_id
    assert _artifacts(client, run_id, "checkpoints/step-00000020") == {
        "checkpoints/step-00000020/model.pt"
    }


def test_each_training_run_gets_its_own_mlflow_run(rank0, client):
    a, b = rank0(), rank0("name=tiny_b")
    a.full_run()
    b.full_run()
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted(r.info.run_name for r in runs) == ["tiny", "tiny_b"]


def test_stopped_and_failed_runs_get_their_mlflow_status(rank0, client):
    r0 = rank0()
    r0.start()
    r0.steps(1, 10)
    r0.end(status="stopped")
    assert only_run(client).info.status == "KILLED"
    # A run that failed for good is closed from the driver (its workers are gone).
    other = rank0("name=tiny_failed")
    other.start()
    run_id = close_run(other.cfg, str(other.run_dir), {"name": "tiny_failed", "status": "failed"})
    failed = client.get_run(run_id)
    assert failed.info.status == "FAILED" and failed.data.tags["status"] == "failed"
    assert close_run(other.cfg, str(other.run_dir.parent / "never-ran"), {}) is None


def test_an_abandoned_run_is_ended_by_fresh_default_callbacks(rank0, client, caplog):
    """Ray Train gave up: the workers never reached on_run_end, so the driver
    calls on_run_abandoned on a fresh callback list from the same factory."""
    r0 = rank0()
    r0.start()
    r0.steps(1, 25)
    r0.callbacks.callbacks[0].flush()  # the dead workers' points had landed
    failed = {
        "name": "tiny",
        "status": "failed",
        "error": "gave up after Ray Train worker failures",
    }
    fresh = CallbackList(default_callbacks(r0.cfg))
    fresh.on_run_abandoned(str(r0.run_dir), failed)
    assert ".on_run_abandoned failed" not in caplog.text  # no callback raised
    run = only_run(client)  # the training run's MLflow run, no new one
    run_id = run.info.run_id
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert run.data.tags["status"] == "failed"
    assert json.loads(artifact_text(client, run_id, "run_summary.json")) == failed
    assert {"alerts.jsonl", "loss_curve.png", "mix_shares.png"} <= _artifacts(client, run_id)
    assert _steps(client, run_id, "loss") == [5, 10, 15, 20, 25]
    assert fresh.callbacks[1].sinks == []  # the monitor ignores the hook
    # A run directory that never got an MLflow run: nothing created, nothing raised.
    CallbackList(default_callbacks(r0.cfg)).on_run_abandoned(
        str(r0.run_dir.parent / "never-ran"), failed
    )
    assert only_run(client).info.run_id == run_id
    assert ".on_run_abandoned failed" not in caplog.text


def test_callbacks_pickle_before_start_and_log_nothing_until_then(rank0):
    r0 = rank0()
    callbacks = pickle.loads(pickle.dumps(default_callbacks(r0.cfg)))
    callbacks[0].on_step_end(1, {"loss": 1.0})  # no run yet: ignored, no error
    assert callbacks[0].run_id is None


def test_system_metrics_are_logged_when_enabled(rank0, client, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    r0 = rank0("tracking.system_metrics=true")
    r0.start()
    run_id = only_run(client).info.run_id
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if "system/cpu_utilization_percentage" in client.get_run(run_id).data.metrics:
            break
        time.sleep(0.2)
    r0.end()
    assert "system/cpu_utilization_percentage" in client.get_run(run_id).data.metrics
    assert "system/system_memory_usage_megabytes" in client.get_run(run_id).data.metrics


def test_git_info_reads_a_checkout(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.delenv("TRAINLAB_GIT_COMMIT", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    run = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (repo / "f.txt").write_text("a")
    run("add", "f.txt")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    assert git_info(repo) == {"commit": sha, "dirty": "false"}
    (repo / "f.txt").write_text("b")
    assert git_info(repo) == {"commit": sha, "dirty": "true"}
    assert git_info(tmp_path / "missing") == {"commit": "unknown", "dirty": "unknown"}


def test_a_tracking_outage_never_stops_training(rank0, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("TRAINLAB_STORE_END_WAIT_S", "0.5")
    r0 = rank0()
    callbacks = r0.start()  # the store does not answer: records wait in the journal
    r0.steps(1, 30, loss=lambda s: float("nan") if s == 20 else 3.0)
    summary = {"name": r0.cfg.name, "status": "completed"}
    callbacks.on_run_end(summary)
    assert "MLflow store did not answer" in caplog.text
    tracker = callbacks.callbacks[0]
    assert tracker.run_id is None
    assert summary["records_pending"] == tracker.records_pending > 0
    assert (r0.run_dir / "logs" / "mlflow-journal.jsonl").is_file()
    # Monitoring goes on without MLflow: the alert still reaches the run log.
    assert [a.rule for a in callbacks.callbacks[1].alerts] == ["non_finite"]
    assert (r0.run_dir / "logs" / "alerts.jsonl").is_file()


def test_peak_memory_is_recorded_next_to_the_plans_estimate(rank0, client):
    r0 = rank0()
    r0.start()
    r0.steps(1, 4)
    r0.end(final_step=4, peak_memory_bytes=3 * 2**30, planned_memory_bytes=4 * 2**30)
    metrics = only_run(client).data.metrics
    assert metrics["peak_memory_bytes"] == 3 * 2**30
    assert metrics["planned_memory_bytes"] == 4 * 2**30
    assert metrics["memory_estimate_error"] == pytest.approx(4 / 3 - 1)
