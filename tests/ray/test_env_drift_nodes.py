"""The node check on a real multi-node cluster (trainlab.envlock.check_nodes):
one raylet whose processes see another version of a small locked package stops
`trainlab train` before any worker starts, naming that node and the package;
`--allow-env-drift` trains anyway and the run records the drift.

The drifted node joins the session's shared cluster for this module only
(`trainlab.rayjobs.localcluster.start_worker`, as `cluster add-node` starts one)
with a PYTHONPATH that puts a copy of `filelock` (a runtime dependency, pinned in
requirements/cpu.txt) with another version in its metadata ahead of the venv's:
every process of that node imports and reports it, as a machine where someone
pip-installed another filelock would. It has no CPUs (training stays on the head)
and is stopped afterwards, so the shared cluster is left as it was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.train_helpers import dataset_dir, tiny_config
from trainlab import envlock
from trainlab.cli import cli
from trainlab.config import to_yaml

pytestmark = [pytest.mark.ray]

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "filelock"


def _shadow(where: Path, version: str) -> Path:
    """A directory holding this venv's `filelock` and its metadata with `version`."""
    import importlib.metadata as md

    dist = md.distribution(PACKAGE)
    source = Path(dist.locate_file(PACKAGE))
    shutil.copytree(source, where / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    info = where / f"{PACKAGE}-{version}.dist-info"
    info.mkdir()
    metadata = dist.read_text("METADATA")
    assert f"\nVersion: {dist.version}\n" in metadata
    (info / "METADATA").write_text(
        metadata.replace(f"\nVersion: {dist.version}\n", f"\nVersion: {version}\n", 1)
    )
    return where


def _alive(node_id: str) -> bool:
    import ray

    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


@pytest.fixture(scope="module")
def drifted_node(ray_cluster, tmp_path_factory):
    """(label the check prints for it, locked version, its version): one more raylet
    of the shared cluster whose processes see another `filelock`."""
    import ray

    from trainlab.rayjobs.localcluster import node_id, start_worker, stop_group

    locked = envlock.read_lock(envlock.lock_path("cpu"))[PACKAGE]
    version = f"{locked}.post999"  # not the lock's, still a valid version
    shadow = _shadow(tmp_path_factory.mktemp("shadow"), version)
    # Short: Ray's unix sockets live under it (108-byte limit on Linux).
    temp_dir = Path(tempfile.mkdtemp(prefix="tl-drift-", dir="/tmp"))
    pythonpath = os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")]))
    node = start_worker(
        ray.get_runtime_context().gcs_address,
        0,  # no CPUs: the node check's tasks reserve none, training stays on the head
        temp_dir / "ray",
        temp_dir / "node.log",
        timeout_s=180,
        env={"PYTHONPATH": pythonpath},
    )
    nid = ""
    try:
        nid = node_id(node)
        deadline = time.monotonic() + 60
        while not _alive(nid):  # registered with the head
            assert time.monotonic() < deadline, "the drifted node did not join"
            time.sleep(0.2)
        # The check names a node by its address, with its id where nodes share one.
        shared = any(
            n["NodeManagerAddress"] == "127.0.0.1" and n["NodeID"] != nid
            for n in ray.nodes()
            if n["Alive"]
        )
        label = f"node 127.0.0.1 ({nid[:8]})" if shared else "node 127.0.0.1"
        yield label, locked, version
    finally:
        stop_group(node.pgid)
        deadline = time.monotonic() + 60
        while nid and _alive(nid) and time.monotonic() < deadline:  # others place workers
            time.sleep(0.2)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    cfg = tiny_config(
        dataset_dir(tmp_path_factory),
        train={
            "total_steps": 2,
            "warmup_steps": 1,
            "log_interval": 1,
            "eval_interval": 2,
            "checkpoint": {"every_steps": 2, "keep_last": 1, "keep_best": 0},
        },
    )
    path = tmp_path_factory.mktemp("drift-config") / "exp.yaml"
    path.write_text(to_yaml(cfg))
    return path


def test_a_node_off_the_lock_stops_train_before_any_worker_naming_node_and_package(
    drifted_node, config_file, tmp_path
):
    import ray

    label, locked, version = drifted_node
    runs = tmp_path / "runs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainlab",
            "train",
            str(config_file),
            "--set",
            f"train.runs_root={runs}",
        ],
        cwd=REPO,
        env={**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    # One line for the one node and package, then what to do; the head is on its lock.
    assert errors[0] == f"error: {label}: {PACKAGE} {version} != {locked} (lock)", errors
    assert len(errors) == 2 and "--allow-env-drift" in errors[1], errors
    assert "Traceback" not in proc.stderr
    # Refused before any worker started: the new run's directory is gone again.
    assert not runs.exists() or not any(runs.iterdir()), sorted(runs.rglob("*"))


def _alive_count() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"])


def test_allowed_drift_is_returned_and_recorded_in_the_run(drifted_node, tmp_path, monkeypatch):
    """What `--allow-env-drift` changes (it sets TRAINLAB_ALLOW_ENV_DRIFT, which a
    submitted job gets too): the same check lets the run start and writes the drift
    into the run's environment.json, which run_summary.json's `environment` is
    (a real run's: tests/ray/test_repeats.py; all of it through `train`: below)."""
    label, locked, version = drifted_node
    line = f"{label}: {PACKAGE} {version} != {locked} (lock)"
    monkeypatch.setenv(envlock.ALLOW_DRIFT_ENV, "1")
    assert envlock.check_nodes(tmp_path) == [line]
    recorded = json.loads((tmp_path / envlock.ENV_FILE).read_text())
    assert recorded["drift"] == [line] and recorded["nodes"] == _alive_count()
    assert envlock.run_environment(tmp_path) == recorded
    assert envlock.mlflow_tags(recorded)["env.drift"] == line


@pytest.mark.extended  # a whole training run (~50 s); its parts: the two tests above
def test_train_with_allow_env_drift_trains_and_its_summary_records_the_drift(
    drifted_node, config_file, tmp_path, monkeypatch
):
    label, locked, version = drifted_node
    line = f"{label}: {PACKAGE} {version} != {locked} (lock)"
    # `--allow-env-drift` sets it in this (the CLI's) process: undone afterwards.
    monkeypatch.setenv(envlock.ALLOW_DRIFT_ENV, "")
    result = CliRunner().invoke(
        cli,
        [
            "train",
            str(config_file),
            "--allow-env-drift",
            "--json",
            "--set",
            f"train.runs_root={tmp_path / 'runs'}",
        ],
        standalone_mode=False,
    )
    assert result.exception is None and result.return_value == 0, result.output[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["status"] == "completed" and summary["final_step"] == 2
    assert summary["environment"]["drift"] == [line]
    assert summary["environment"]["nodes"] == _alive_count()
