"""Where alerts go: the run log, the MLflow run, webhooks and commands
(`tracking.alerts.routes` says which go to each severity; monitor.callback).

A sink never raises into training: a failed delivery is logged and dropped.
The webhook posts from a one-worker `concurrent.futures.ThreadPoolExecutor`
(in order), so a slow or dead endpoint never stalls a training step; `close()`
waits (bounded) for posts still queued and drops, with a warning, what is left.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any, Protocol

from trainlab.errors import UserError
from trainlab.monitor.rules import Alert

log = logging.getLogger("trainlab.alerts")

WEBHOOK_TIMEOUT_S = 5.0
WEBHOOK_ATTEMPTS = 3
CLOSE_TIMEOUT_S = 15.0
COMMAND_TIMEOUT_S = 30.0


class Sink(Protocol):
    def send(self, alert: Alert) -> None: ...

    def close(self) -> None: ...


class RunLogSink:
    """The run's log (logger `trainlab.alerts`) and its alert log, one JSON object per line."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def send(self, alert: Alert) -> None:
        level = logging.ERROR if alert.severity == "P0" else logging.WARNING
        log.log(
            level,
            "ALERT %s %s at step %d: %s",
            alert.severity,
            alert.rule,
            alert.step,
            alert.message,
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(alert.to_json(), sort_keys=True) + "\n")

    def close(self) -> None:
        pass


class MlflowSink:
    """Tags on the MLflow run (`alert.<rule>`, `alerts_fired`) and the alert log as artifact."""

    def __init__(self, tracker: Any, alert_log: str | Path):
        self.tracker = tracker
        self.alert_log = Path(alert_log)
        self.fired = 0

    def send(self, alert: Alert) -> None:
        self.fired += 1
        self.tracker.set_tags(
            {
                f"alert.{alert.rule}": f"{alert.severity} at step {alert.step}: {alert.message}",
                "alerts_fired": str(self.fired),
            }
        )
        if self.alert_log.is_file():
            self.tracker.log_artifact(str(self.alert_log))

    def close(self) -> None:
        pass


def check_webhook_url(url: str, env_name: str) -> str:
    if not url.startswith(("http://", "https://")):
        # Say where the value came from, never the value: it may hold a secret.
        raise UserError(f"${env_name}: the alert webhook URL must start with http:// or https://")
    return url


class WebhookSink:
    """HTTP POST of `{run, rule, severity, step, value, message, ...}` as JSON."""

    def __init__(self, url: str, timeout: float = WEBHOOK_TIMEOUT_S):
        self.url = url
        self.timeout = timeout
        self.delivered = 0
        self._posts: list[Future[None]] = []  # not yet known to be done
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainlab-webhook")

    def send(self, alert: Alert) -> None:
        self._posts = [f for f in self._posts if not f.done()]
        self._posts.append(self._executor.submit(self._post, alert.to_json()))

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Wait up to `timeout` for the posts still queued; drop the rest (a post in
        flight finishes in the background, within its own timeouts)."""
        _, pending = wait_futures(self._posts, timeout)
        self._posts = []
        self._executor.shutdown(wait=False, cancel_futures=True)
        if pending:
            log.warning(
                "alert webhook: %d alert post(s) still pending at close, dropped", len(pending)
            )

    def _post(self, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        request = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "trainlab-alerts"},
        )
        for attempt in range(1, WEBHOOK_ATTEMPTS + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    response.read()
                self.delivered += 1
                return
            except (urllib.error.URLError, OSError) as e:
                if attempt == WEBHOOK_ATTEMPTS:
                    log.warning(
                        "alert webhook: %s at step %s not delivered after %d attempts (%s)",
                        payload["rule"],
                        payload["step"],
                        attempt,
                        e,
                    )
                    return
                time.sleep(0.5 * attempt)
            except Exception as e:  # noqa: BLE001 - e.g. a malformed HTTP reply: not retried
                log.warning(
                    "alert webhook: %s at step %s not delivered (%s: %s)",
                    payload["rule"],
                    payload["step"],
                    type(e).__name__,
                    e,
                )
                return


class CommandSink:
    """Runs `argv` (no shell) with the alert as JSON on stdin, from a one-worker
    background thread (in order, like the webhook), each run bounded by `timeout`."""

    def __init__(self, argv: list[str], timeout: float = COMMAND_TIMEOUT_S):
        self.argv, self.timeout = list(argv), timeout
        self.delivered = 0
        self._runs: list[Future[None]] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainlab-alert-cmd")

    def send(self, alert: Alert) -> None:
        self._runs = [f for f in self._runs if not f.done()]
        self._runs.append(self._executor.submit(self._run, alert.to_json()))

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        _, pending = wait_futures(self._runs, timeout)
        self._runs = []
        self._executor.shutdown(wait=False, cancel_futures=True)
        if pending:
            log.warning("alert command: %d run(s) still pending at close, dropped", len(pending))

    def _run(self, payload: dict[str, Any]) -> None:
        import subprocess

        try:
            done = subprocess.run(
                self.argv,
                input=json.dumps(payload).encode(),
                capture_output=True,
                timeout=self.timeout,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("alert command %s failed for %s: %s", self.argv[0], payload["rule"], e)
            return
        if done.returncode != 0:
            log.warning(
                "alert command %s exited %d for %s", self.argv[0], done.returncode, payload["rule"]
            )
            return
        self.delivered += 1
