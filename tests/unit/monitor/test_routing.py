"""Severity routing: each level reaches its destinations only. Real hooks: two
webhooks on a real local HTTP server (page, message) and a command; the run log
and the alert log; a P2 alert is only recorded. Hook variables are secrets:
never forwarded to workers in their environment."""

from __future__ import annotations

import json
import queue
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from tests.train_helpers import new_run_context
from trainlab.config import load_config
from trainlab.monitor import MonitorCallback, alert_log_path
from trainlab.monitor.rules import Alert
from trainlab.train.driver.launcher import forwarded_env

RECIPES = Path(__file__).resolve().parents[3] / "trainers" / "recipes"


@pytest.fixture
def hook_server():
    """A real HTTP server on 127.0.0.1; yields (base url, queue of (path, alert))."""
    received: queue.Queue = queue.Queue()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.put((self.path, json.loads(body)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", received
    server.shutdown()
    server.server_close()


def monitor_for(tmp_path: Path, *overrides: str) -> MonitorCallback:
    cfg = load_config(RECIPES / "tiny.yaml", list(overrides))
    monitor = MonitorCallback(cfg)
    monitor.on_run_start(new_run_context(cfg, tmp_path / "run"))
    return monitor


def drain(received: queue.Queue) -> list[tuple[str, str]]:
    out = []
    while not received.empty():
        path, body = received.get()
        out.append((path, body["severity"]))
    return sorted(out)


def test_default_routes_page_on_p0_message_on_p1_and_only_record_p2(
    hook_server, tmp_path, monkeypatch
):
    base, received = hook_server
    monkeypatch.setenv("TRAINLAB_PAGE_WEBHOOK", f"{base}/page")
    monkeypatch.setenv("TRAINLAB_MESSAGE_WEBHOOK", f"{base}/message")
    monitor = monitor_for(tmp_path)
    for step, severity in ((10, "P0"), (20, "P1"), (30, "P2")):
        monitor._emit(Alert(f"rule_{severity}", severity, step, 1.0, "test"))
    monitor.on_run_end({})  # waits for the queued posts
    assert drain(received) == [("/message", "P0"), ("/message", "P1"), ("/page", "P0")]
    logged = [json.loads(x) for x in alert_log_path(tmp_path / "run").read_text().splitlines()]
    assert [a["severity"] for a in logged] == ["P0", "P1", "P2"]  # the log gets all


def test_configured_routes_and_a_command_hook(hook_server, tmp_path, monkeypatch):
    base, received = hook_server
    out = tmp_path / "cmd-alerts.jsonl"
    script = f"import sys; open({str(out)!r}, 'a').write(sys.stdin.read() + '\\n')"
    monkeypatch.setenv("MY_TEAM_HOOK", f"{base}/team")
    monitor = monitor_for(
        tmp_path,
        f"tracking.alerts.hooks={{team: {{webhook_url_env: MY_TEAM_HOOK}}, "
        f"script: {{command: [{sys.executable}, -c, {json.dumps(script)}]}}}}",
        "tracking.alerts.routes={P0: [log, team, script], P1: [script], P2: []}",
    )
    for step, severity in ((10, "P0"), (20, "P1"), (30, "P2")):
        monitor._emit(Alert(f"rule_{severity}", severity, step, 1.0, "test"))
    monitor.on_run_end({})
    assert drain(received) == [("/team", "P0")]
    ran = [json.loads(x)["severity"] for x in out.read_text().splitlines() if x]
    assert sorted(ran) == ["P0", "P1"]
    logged = [json.loads(x) for x in alert_log_path(tmp_path / "run").read_text().splitlines()]
    assert [a["severity"] for a in logged] == ["P0"]  # only P0 routes to the log here


def test_hook_variables_are_secrets_never_forwarded(monkeypatch):
    cfg = load_config(
        RECIPES / "tiny.yaml",
        [
            "tracking.alerts.hooks={pager: {webhook_url_env: TRAINLAB_ONCALL_URL}}",
            "tracking.alerts.routes={P0: [log, pager]}",
        ],
    )
    assert "TRAINLAB_ONCALL_URL" in cfg.tracking.alerts.secret_env_names()
    monkeypatch.setenv("TRAINLAB_ONCALL_URL", "http://127.0.0.1:9/oncall")
    monkeypatch.setenv("TRAINLAB_GIT_COMMIT", "c0ffee")
    env = forwarded_env(cfg)
    assert "TRAINLAB_ONCALL_URL" not in env and env.get("TRAINLAB_GIT_COMMIT") == "c0ffee"


def test_unknown_route_destination_is_a_config_error():
    from trainlab.errors import UserError

    with pytest.raises(UserError, match=r"tracking.alerts.routes.P1 = 'pager': not a destination"):
        load_config(RECIPES / "tiny.yaml", ["tracking.alerts.routes.P1=[log, pager]"])
