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

from tests.unit.track.conftest import only_run

STARTUP_TIMEOUT_S = 180  # the server imports a lot; 2 busy cores can be slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read()


@pytest.mark.slow
def test_ui_serves_the_runs_store_on_loopback_only(rank0, client, runs_root, tmp_path):
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
