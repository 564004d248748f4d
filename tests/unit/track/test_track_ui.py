"""`trainlab ui`: a real MLflow server on 127.0.0.1 against the runs store, showing
the recorded run's params and artifacts; in a real browser (headless Chromium),
an experiment opens on its runs table and a run's charts start with the loss."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from tests import chromium
from tests.unit.track.conftest import FakeRank0, only_run, tiny_config

STARTUP_TIMEOUT_S = 180  # the server imports a lot; 2 busy cores can be slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read()


@contextmanager
def served(runs_root: Path, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """`trainlab ui` on a free port, once it answers: (its URL, the process)."""
    port = _free_port()
    trainlab = Path(sys.executable).with_name("trainlab")
    log_path = tmp_path / "ui.log"
    log = log_path.open("w")
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
            assert server.poll() is None, log_path.read_text()
            try:
                if _get(f"{base}/health") == b"OK":
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(1)
        yield base, server
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the group we started, nothing else
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.mark.slow
def test_ui_serves_the_runs_store_on_loopback_only(rank0, client, runs_root, tmp_path, monkeypatch):
    played = rank0()
    played.full_run()
    run_id = only_run(client).info.run_id
    with served(runs_root, tmp_path) as (base, server):
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
    # What the user sees: trainlab's line and MLflow's two notices; no INFO line per
    # start-up phase or request, no starlette deprecation warning (issue 41 item 8).
    said = (tmp_path / "ui.log").read_text()
    assert "MLflow UI for sqlite:///" in said
    assert " INFO" not in said and "DeprecationWarning" not in said, said


# The chart sections of a run's "Model metrics" tab, in the order shown: each
# section's title is its name, then its chart count on a line of its own ("loss",
# "(2)"), read as "loss (2)".
SECTION_TITLES = r"""(lines => lines.flatMap((line, i) =>
  i > 0 && /^\(\d+\)$/.test(line) ? [lines[i - 1] + ' ' + line] : []))
  (document.body.innerText.split('\n').map(l => l.trim()))"""


@pytest.mark.slow
def test_in_a_browser_an_experiment_opens_on_its_runs_and_a_run_on_its_loss(
    rank0, client, runs_root, tmp_path
):
    """A first visit (a fresh browser profile) to `trainlab ui`: the experiment's
    link opens its runs table (not the GenAI overview), the run's page is under
    Runs, and its charts start with the loss section (train, then val)."""
    played = rank0()
    played.full_run()
    run = only_run(client)
    with served(runs_root, tmp_path) as (base, _), chromium.Browser() as browser:
        try:
            browser.open(f"{base}/#/experiments")
            browser.click(played.cfg.name)
            page = browser.wait_for(
                "/#\\/experiments\\/\\d+\\/[a-z]/.test(location.href) && location.href",
                what="the experiment's page",
            )
            assert "/runs" in page and "overview" not in page, page
            browser.wait_for(
                f"document.body.innerText.includes({run.info.run_name!r})", what="the run's row"
            )
            text = browser.evaluate("document.body.innerText")
            assert "No data available" not in text and "Detect Issues" not in text, text[:600]
            # The table itself (the breadcrumb names the run too: `tiny`), then its rows drawn.
            browser.wait_for(
                f"!!document.querySelector('a[href*=\"{run.info.run_id}\"]')", what="the run's link"
            )
            time.sleep(2)
            shots = [_screenshot(browser, tmp_path / "mlflow-runs-view.png")]
            browser.click(run.info.run_name, href_part=run.info.run_id)
            browser.wait_for(f"location.href.includes({run.info.run_id!r})", what="the run page")
            header = browser.wait_for(
                "(t => t.includes('Model metrics') && t.split('Model metrics')[0])"
                "(document.body.innerText)",
                what="the run page's tabs",
            )
            assert "Runs" in header and "Evaluations" not in header, header  # its breadcrumb
            browser.evaluate("location.hash = location.hash.split('?')[0] + '/model-metrics'")
            sections = browser.wait_for(
                f"(() => {{ const s = {SECTION_TITLES}; return s.length >= 3 && s; }})()",
                what="the chart sections",
            )
            assert sections[0] == "loss (2)", sections
            assert {"share (3)", "val_loss (3)"} <= set(sections), sections
            browser.wait_for("document.querySelectorAll('canvas, svg path').length > 0")
            time.sleep(2)  # the charts draw their lines after their frames
            shots.append(_screenshot(browser, tmp_path / "mlflow-loss-chart.png"))
        finally:
            browser.screenshot(tmp_path / "mlflow-ui.png")  # what the page showed last
    # The README's screenshots (docs/images/) are these: `make screenshots` runs this
    # test with TRAINLAB_SCREENSHOTS=docs/images.
    target = os.environ.get("TRAINLAB_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        for shot in shots:
            shutil.copyfile(shot, Path(target) / shot.name)


def _screenshot(browser: chromium.Browser, path: Path) -> Path:
    """A screenshot of the page as shown, checked to be a real PNG of the window."""
    browser.screenshot(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, (path, len(data))
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width == 1400 and height > 600, (width, height)  # the window's viewport
    return path


def test_the_ui_app_is_mlflows_with_model_training_as_the_first_visit_default():
    """`trainlab ui` runs MLflow's app under its `mlflow.app` entry point; its page
    is MLflow's, with the "Model training" default set before MLflow's bundle runs
    (only when the browser has no choice of its own)."""
    from mlflow.server import app as flask_app

    from trainlab.track import mlflow_ui

    assert mlflow_ui.installed(), "reinstall: .venv/bin/pip install --no-deps -e ."
    mlflow_ui.create_app()
    page = flask_app.test_client().get("/").get_data(as_text=True)
    script = page.index(mlflow_ui.DEFAULT_WORKFLOW_SCRIPT)
    assert script < page.index("static-files/static/js/main.")
    assert "localStorage.getItem(\"mlflow.workflowType_v1\")===null" in page
