"""`trainlab ui`: a real MLflow server on 127.0.0.1 against the runs store, showing
the recorded run's params and artifacts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.unit.track.conftest import FakeRank0, only_run, tiny_config

STARTUP_TIMEOUT_S = 180  # the server imports a lot; 2 busy cores can be slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read()


@pytest.mark.slow
def test_ui_serves_the_runs_store_on_loopback_only(rank0, client, runs_root, tmp_path, monkeypatch):
    played = rank0()
    played.full_run()
    run_id = only_run(client).info.run_id
    port = _free_port()
    trainlab = Path(sys.executable).with_name("trainlab")
    log = (tmp_path / "ui.log").open("w")
    server = subprocess.Popen(
        [str(trainlab), "ui", "--port", str(port), "--runs-root", str(runs_root)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert server.poll() is None, (tmp_path / "ui.log").read_text()
            try:
                if _get(f"{base}/health") == b"OK":
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "ui.log").read_text()
            time.sleep(1)
        run = json.loads(_get(f"{base}/ajax-api/2.0/mlflow/runs/get?run_id={run_id}"))["run"]
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        assert float(params["train.lr"]) == played.cfg.train.lr
        plan = json.loads(_get(f"{base}/get-artifact?path=plan.json&run_uuid={run_id}"))
        assert plan["num_params"] > 0
        # A run recorded through the server (MLFLOW_TRACKING_URI set, as with a
        # tracking server on a cluster): its own runs root gets no store of its own,
        # the record lands in the server's, read back over HTTP.
        from mlflow import MlflowClient

        monkeypatch.setenv("MLFLOW_TRACKING_URI", base)
        elsewhere = tmp_path / "elsewhere"
        FakeRank0(tiny_config(elsewhere, "name=served"), elsewhere).full_run()
        assert not (elsewhere / "mlflow.db").exists()
        remote = MlflowClient(base)
        experiments = [e.experiment_id for e in remote.search_experiments()]
        (found,) = remote.search_runs(experiments, "attributes.run_name = 'served'")
        steps = [m.step for m in remote.get_metric_history(found.info.run_id, "loss")]
        assert steps and steps == sorted(set(steps))
        assert found.data.tags["config_hash"] and found.info.status == "FINISHED"
        artifacts = {a.path for a in remote.list_artifacts(found.info.run_id)}
        assert {"run_summary.json", "plan.json"} <= artifacts, artifacts
        assert {r.info.run_name for r in client.search_runs(experiments)} >= {"served"}
        listening = {
            c.laddr
            for p in [
                psutil.Process(server.pid),
                *psutil.Process(server.pid).children(recursive=True),
            ]
            for c in p.net_connections("inet")
            if c.status == psutil.CONN_LISTEN
        }
        assert listening and {addr.ip for addr in listening} == {"127.0.0.1"}
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the group we started, nothing else
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
