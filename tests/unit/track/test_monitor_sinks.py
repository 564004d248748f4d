"""Alert sinks: the webhook received by a real HTTP server on 127.0.0.1, a dead
webhook that never stalls training, and the MLflow sink (tag + alert log artifact)."""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tests.unit.track.conftest import artifact_text, only_run
from trainlab.monitor import WebhookSink
from trainlab.monitor.rules import Alert

ENV = "TRAINLAB_TEST_ALERT_WEBHOOK"


@pytest.fixture
def webhook_server():
    """A real HTTP server on 127.0.0.1 (port 0); yields (url, queue of received posts)."""
    received: queue.Queue = queue.Queue()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.put((self.path, self.headers["Content-Type"], json.loads(body)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/hooks/alerts", received
    server.shutdown()
    server.server_close()


def _nan_at(callbacks, step):
    for s in range(5, step, 5):
        callbacks.on_step_end(s, {"loss": 5.0 - s / 100, "grad_norm": 1.0, "tokens_per_s": 5e3})
    callbacks.on_step_end(step, {"loss": math.nan, "grad_norm": 1.0, "tokens_per_s": 5e3})


def test_webhook_receives_the_alert_as_json(rank0, client, webhook_server, monkeypatch):
    url, received = webhook_server
    monkeypatch.setenv(ENV, url)
    r0 = rank0(f"tracking.alerts.webhook_url_env={ENV}")
    callbacks = r0.start()
    _nan_at(callbacks, 30)
    path, content_type, body = received.get(timeout=30)
    assert path == "/hooks/alerts" and content_type == "application/json"
    assert {k: body[k] for k in ("run", "rule", "severity", "step", "value")} == {
        "run": "tiny",
        "rule": "non_finite",
        "severity": "P0",
        "step": 30,
        "value": "nan",
    }
    assert "loss is nan" in body["message"]
    assert body["run_id"] == only_run(client).info.run_id
    r0.end()
    assert received.empty()  # exactly one post


def test_mlflow_sink_tags_the_run_and_uploads_the_alert_log(rank0, client):
    r0 = rank0()
    callbacks = r0.start()
    _nan_at(callbacks, 30)
    callbacks.callbacks[0].flush()  # records reach the store from the run's journal
    run = only_run(client)
    assert run.data.tags["alert.non_finite"].startswith("P0 at step 30: loss is nan")
    assert run.data.tags["alerts_fired"] == "1"
    logged = artifact_text(client, run.info.run_id, "alerts.jsonl")
    assert json.loads(logged)["rule"] == "non_finite"
    r0.end()
    # The alert count is also a metric, so it sits on the curves.
    history = client.get_metric_history(run.info.run_id, "alerts_fired")
    assert [(m.step, m.value) for m in history][-2:] == [(25, 0.0), (30, 1.0)]


def test_a_dead_webhook_never_stalls_or_fails_training(monkeypatch):
    import socket

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = WebhookSink(f"http://127.0.0.1:{port}/", timeout=1.0)
    t0 = time.perf_counter()
    sink.send(Alert("non_finite", "P0", 3, math.inf, "grad_norm is inf"))
    assert time.perf_counter() - t0 < 0.5  # posted from a background thread
    sink.close()  # retries give up with a logged warning, no exception
    assert sink.delivered == 0


def test_webhook_url_must_be_http(rank0, monkeypatch, caplog):
    monkeypatch.setenv(ENV, "file:///etc/passwd")
    r0 = rank0(f"tracking.alerts.webhook_url_env={ENV}")
    callbacks = r0.start()
    monitor = callbacks.callbacks[1]
    assert not any(isinstance(s, WebhookSink) for s in monitor.sinks)
    assert "must start with http:// or https://" in caplog.text
    assert "/etc/passwd" not in caplog.text  # the value may be a secret: never echoed


def test_unset_default_hooks_are_noted_once_per_run_not_at_every_restart(
    rank0, monkeypatch, caplog
):
    """The default hooks' variables unset (most machines): one note each on the run's
    first start; an in-place restart (the same callbacks started again) and a
    worker-group restart or resume (new callbacks, restarts > 0) say nothing more."""
    import logging

    monkeypatch.delenv("TRAINLAB_PAGE_WEBHOOK", raising=False)
    monkeypatch.delenv("TRAINLAB_MESSAGE_WEBHOOK", raising=False)
    caplog.set_level(logging.INFO, logger="trainlab.monitor")
    r0 = rank0()
    r0.start()
    r0.start(in_place=True)
    r0.start(restarts=1)
    notes = [r.getMessage() for r in caplog.records if "is not set in this process" in r.message]
    assert len(notes) == 2, notes  # TRAINLAB_PAGE_WEBHOOK, TRAINLAB_MESSAGE_WEBHOOK: once each
    assert {n.split("$")[1].split(" ")[0] for n in notes} == {
        "TRAINLAB_PAGE_WEBHOOK",
        "TRAINLAB_MESSAGE_WEBHOOK",
    }
