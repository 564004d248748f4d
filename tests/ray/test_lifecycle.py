"""A run's life on the real supervised path: Ctrl-C as a terminal sends it (SIGINT
to the whole process group of `trainlab train`), during training and during
startup, and the resume that continues the interrupted run.

The commands run as subprocesses in their own session, connected to the
session's Ray cluster (RAY_ADDRESS) so that they do not start one each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.train_helpers import dataset_dir, tiny_config
from trainlab.config import to_yaml
from trainlab.exitcodes import INTERRUPTED

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# A Ctrl-C during start-up ends the command within this (~N s measured on the 2
# loaded cores; the whole start-up it used to wait for took 78 s).
STARTUP_CTRL_C_S = 15


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


@pytest.fixture
def ray_address(ray_cluster) -> str:
    import ray

    return ray.get_runtime_context().gcs_address


def start_train(args: list[str], address: str) -> subprocess.Popen:
    """`trainlab train ARGS --json` in a new session (its own process group, as a
    terminal's foreground job is)."""
    env = {**os.environ, "RAY_ADDRESS": address}
    return subprocess.Popen(
        [sys.executable, "-m", "trainlab", "train", *args, "--json"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for(path_glob: Path, proc: subprocess.Popen, timeout: float = 300) -> Path:
    """The first file matching `path_glob` (a pattern under its parent's parents)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = sorted(Path(path_glob.anchor).glob(str(path_glob.relative_to(path_glob.anchor))))
        if found:
            return found[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no {path_glob} within {timeout} s: {proc.communicate()[1][-3000:]}")


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def assert_no_traceback(err: str) -> None:
    for word in ("Traceback", "EOFError"):
        at = err.find(word)
        assert at < 0, err[max(0, at - 500) : at + 2500]


def mlflow_runs(runs_root: Path) -> list:
    """The store's runs (opened as trainlab does: never while a run creates it)."""
    from trainlab.track.backend import client_for

    client = client_for(f"sqlite:///{runs_root}/mlflow.db")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def mlflow_status(runs_root: Path) -> list[tuple[str, str | None]]:
    return [(r.info.status, r.data.tags.get("status")) for r in mlflow_runs(runs_root)]


def active_seconds(runs_root: Path) -> float:
    runs = mlflow_runs(runs_root) if (runs_root / "mlflow.db").is_file() else []
    return float(runs[0].data.tags.get("active_seconds", 0)) if runs else 0.0


def last_heartbeat(runs_root: Path) -> float:
    runs = mlflow_runs(runs_root) if (runs_root / "mlflow.db").is_file() else []
    return float(runs[0].data.tags.get("heartbeat", 0)) if runs else 0.0


def stoppable_run(dataset: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A 40-step run's runs root and config file, checkpointing at any stop
    (`on_interrupt_min_age_s: 0`), for the stop tests below."""
    runs_root = tmp_path / "runs"
    cfg = tiny_config(
        dataset,
        train={
            "total_steps": 40,
            "log_interval": 2,
            "eval_interval": 20,
            "runs_root": str(runs_root),
            "checkpoint": {"every_steps": 20, "on_interrupt_min_age_s": 0},
        },
        tracking={"system_metrics": False},
    )
    config = tmp_path / "exp.yaml"
    config.write_text(to_yaml(cfg))
    return runs_root, config


def test_ctrl_c_stops_at_a_step_with_a_checkpoint_and_resumes(ray_address, dataset, tmp_path):
    """First Ctrl-C during training: stop at the next step boundary, checkpoint
    (`on_interrupt_min_age_s: 0`: always), status `interrupted` in the summary and
    MLflow (KILLED), the exact resume command, exit 130, no traceback. The printed
    command then completes the run. (Without a checkpoint at the stop when the
    newest is recent: tests/unit/train/test_interrupt.py.)"""
    runs_root, config = stoppable_run(dataset, tmp_path)
    proc = start_train([str(config)], ray_address)
    progress = wait_for(runs_root / "*" / "*" / "logs" / "progress.json", proc)
    os.killpg(proc.pid, signal.SIGINT)
    code, out, err = finish(proc)
    assert code == INTERRUPTED, err[-3000:]
    summary = json.loads(out)  # stdout is the JSON alone
    run_dir = progress.parent.parent
    assert summary["status"] == "interrupted" and summary["run_dir"] == str(run_dir)
    assert 2 <= summary["final_step"] < 40
    assert summary["last_checkpoint"].endswith(f"step-{summary['final_step']:08d}")
    assert f"resume with:     trainlab train {run_dir} --resume" in err
    assert_no_traceback(err)
    assert mlflow_status(runs_root) == [("KILLED", "interrupted")]

    proc = start_train([str(run_dir), "--resume"], ray_address)
    code, out, err = finish(proc)
    assert code == 0, err[-3000:]
    resumed = json.loads(out)  # stdout is the JSON alone
    assert resumed["status"] == "completed" and resumed["final_step"] == 40
    assert resumed["start_step"] == summary["final_step"]
    assert mlflow_status(runs_root) == [("FINISHED", "completed")]


# extended (23 s, make test's 30 minutes): SIGTERM's graceful stop and exit 143 are
# tests/unit/train/test_interrupt.py; a Ray job's driver taking `trainlab stop`'s
# SIGTERM is tests/e2e/test_cluster_submit.py.
@pytest.mark.extended
def test_sigterm_to_the_driver_stops_gracefully_and_exits_143(ray_address, dataset, tmp_path):
    """SIGTERM to the driver alone (what a scheduler or Kubernetes sends first) is
    the graceful stop of a first Ctrl-C: the run stops at the next step with a
    checkpoint there, its summary and MLflow say interrupted, and the command
    exits 143 without a traceback. (It used to die at once: exit 15, no summary.)"""
    from trainlab.exitcodes import TERMINATED

    runs_root, config = stoppable_run(dataset, tmp_path)
    proc = start_train([str(config)], ray_address)
    wait_for(runs_root / "*" / "*" / "logs" / "progress.json", proc)
    os.kill(proc.pid, signal.SIGTERM)
    code, out, err = finish(proc)
    assert code == TERMINATED, err[-3000:]
    summary = json.loads(out)
    assert summary["status"] == "interrupted" and 2 <= summary["final_step"] < 40
    assert summary["last_checkpoint"].endswith(f"step-{summary['final_step']:08d}")
    assert "SIGTERM: stopping after the next step" in err
    assert_no_traceback(err)
    assert mlflow_status(runs_root) == [("KILLED", "interrupted")]


def test_ctrl_c_during_startup_ends_at_once_and_says_what_it_waited_for(
    ray_address, dataset, tmp_path
):
    """One Ctrl-C while the run starts (its directory exists, nothing trained yet):
    nothing to save, so the command ends within seconds (it waited for the whole
    start-up before: 78 s seen) with exit 130, the run `interrupted` at step 0 and
    its resume command, no traceback. Its piped stderr said what it was starting
    and has no colour codes."""
    runs_root = tmp_path / "runs"
    cfg = tiny_config(
        dataset,
        train={"total_steps": 40, "runs_root": str(runs_root)},
        tracking={"system_metrics": False},
    )
    config = tmp_path / "exp.yaml"
    config.write_text(to_yaml(cfg))
    proc = start_train([str(config)], ray_address)
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.time() + 300
    while not any("starting: Ray ready" in line for line in said):  # placing the workers
        assert proc.poll() is None and time.time() < deadline, "".join(said)[-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    t0 = time.time()
    out = proc.stdout.read()
    code = proc.wait(timeout=60)
    took = time.time() - t0
    reader.join(timeout=10)
    err = "".join(said)
    assert code == INTERRUPTED, err[-3000:]
    assert took < STARTUP_CTRL_C_S, (took, err[-3000:])
    summary = json.loads(out)  # stdout is the JSON alone
    assert summary["status"] == "interrupted" and summary["final_step"] == 0
    assert "interrupt: still starting" in err
    assert f"trainlab train {summary['run_dir']} --resume" in err
    assert "starting: connecting to the Ray cluster at" in err, err[-3000:]
    assert "\x1b[" not in err and "\x1b[" not in out
    assert_no_traceback(err)


@pytest.mark.extended  # the lost rule itself: tests/unit/track/test_run_lifecycle_records.py
def test_a_run_whose_processes_vanished_shows_lost_and_is_corrected(ray_address, dataset, tmp_path):
    """`kill -9` of the driver's process group (its workers go with it): the MLflow
    run stays RUNNING with a stale heartbeat; `trainlab runs` shows it `lost` and
    ends its record (MLflow FAILED, status tag and run_summary.json `lost`)."""
    runs_root = tmp_path / "runs"
    cfg = tiny_config(
        dataset,
        train={"total_steps": 400, "log_interval": 2, "runs_root": str(runs_root)},
        tracking={"system_metrics": False},
    )
    config = tmp_path / "exp.yaml"
    config.write_text(to_yaml(cfg))
    os.environ["TRAINLAB_HEARTBEAT_S"] = "1"  # forwarded to the workers (TRAINLAB_*)
    try:
        proc = start_train([str(config)], ray_address)
    finally:
        del os.environ["TRAINLAB_HEARTBEAT_S"]
    progress = wait_for(runs_root / "*" / "*" / "logs" / "progress.json", proc)
    deadline = time.time() + 120  # rank 0 records the run in MLflow beside training
    while time.time() < deadline and not active_seconds(runs_root):  # a beat after the first
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert mlflow_status(runs_root) == [("RUNNING", "running")]
    deadline = time.time() + 60  # Ray ends the dead driver's workers, heartbeats stop
    while time.time() < deadline and time.time() - last_heartbeat(runs_root) < 3:
        time.sleep(0.5)
    env = {**os.environ, "TRAINLAB_LOST_AFTER_S": "2"}
    listed = subprocess.run(
        [sys.executable, "-m", "trainlab", "runs", "--json", "--runs-root", str(runs_root)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert row["status"] == "lost" and row["active_s"] > 0
    assert mlflow_status(runs_root) == [("FAILED", "lost")]
    summary = json.loads((progress.parent.parent / "run_summary.json").read_text())
    assert summary["status"] == "lost" and summary["stop_reason"].startswith("lost: no heartbeat")
