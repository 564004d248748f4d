"""The monitoring callback: signals as metrics, alert rules, sinks, and the P0 action.

Signals, logged as metrics beside the loop's own:
- health: loss, grad_norm, tokens_per_s (from the loop);
- resources: mem_gb (loop), cpu_util_pct and rss_gb of the rank-0 process (here),
  plus MLflow's system metrics (CPU, memory, GPU when present);
- progress: step, progress (fraction of train.total_steps), eta_s and ckpt_age_s
  (from the loop when it reports them, else computed here);
- alerts_fired: alerts so far in this process, so alerts sit on the curves.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainlab.errors import UserError
from trainlab.monitor.rules import Alert, Rule, StaleCheckpoint, build_rules
from trainlab.monitor.sinks import MlflowSink, RunLogSink, Sink, WebhookSink, check_webhook_url
from trainlab.train.callbacks import Callback, RunContext

log = logging.getLogger(__name__)


def alert_log_path(run_dir: str | Path) -> Path:
    """The run's alert log: one JSON object per alert, appended across restarts."""
    return Path(run_dir) / "logs" / "alerts.jsonl"


class MonitorCallback(Callback):
    """Evaluates the alert rules on every logged step and fans alerts out to the sinks.

    `tracker` (the MLflow callback) receives the derived signals and the MLflow
    sink's tags; `clock` is injectable so tests can age checkpoints without waiting.
    """

    def __init__(self, cfg: Any, tracker: Any = None, clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.tracker = tracker
        self.clock = clock
        self.alerts: list[Alert] = []
        self.rules: list[Rule] = []
        self.sinks: list[Sink] = []
        self._run_name = cfg.name
        self._start = (0, 0.0)  # (step, time) of this process's start
        self._process: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["sinks"], state["_process"] = [], None
        return state

    # ---------------------------------------------------------------- hooks

    def on_run_start(self, ctx: RunContext) -> None:
        # After an in-place restart the rules start afresh (throughput and loss
        # statistics restart with the processes); alerts so far are kept.
        self.on_run_end({})
        alerts_cfg = ctx.cfg.tracking.alerts
        self.rules = build_rules(alerts_cfg)
        now = self.clock()
        for rule in self.rules:
            if isinstance(rule, StaleCheckpoint):
                rule.start(now)
        self._start = (ctx.start_step, now)
        self.sinks = self._build_sinks(ctx.run_dir, alerts_cfg.webhook_url_env)
        self._process = _this_process()

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        now = self.clock()
        signals = self.signals(step, metrics, now)
        observed = {**signals, **metrics}
        for rule in self.rules:
            alert = rule.observe(step, observed, now)
            if alert is not None:
                self._emit(alert)
        signals["alerts_fired"] = float(len(self.alerts))
        if self.tracker is not None:
            self.tracker.log_metrics(step, signals)

    def on_checkpoint(self, step: int, path: str, valid: bool, val_loss: float | None) -> None:
        if not valid:
            return
        for rule in self.rules:
            if isinstance(rule, StaleCheckpoint):
                rule.checkpoint_saved(self.clock())

    def on_run_end(self, summary: dict[str, Any]) -> None:
        """Close the sinks: queued webhook posts are delivered (bounded wait)."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception:  # noqa: BLE001 - closing a sink must not fail the run's end
                log.exception("closing alert sink %s failed", type(sink).__name__)

    def on_run_abandoned(self, run_dir: str, summary: dict[str, Any]) -> None:
        """Nothing to close: sinks live in the process that ran the steps, and this
        (fresh) instance opened none."""

    # ---------------------------------------------------------------- signals

    def signals(self, step: int, metrics: dict[str, float], now: float) -> dict[str, float]:
        """Resource and progress signals this callback adds to the loop's metrics."""
        total = self.cfg.train.total_steps
        out: dict[str, float] = {"progress": step / total}
        start_step, start_time = self._start
        if "eta_s" not in metrics and step > start_step:
            out["eta_s"] = (now - start_time) / (step - start_step) * (total - step)
        if "ckpt_age_s" not in metrics:
            stale = next((r for r in self.rules if isinstance(r, StaleCheckpoint)), None)
            age = stale.age_s(now) if stale is not None else None
            if age is not None:
                out["ckpt_age_s"] = age
        if self._process is not None:
            out["cpu_util_pct"] = self._process.cpu_percent(None)
            out["rss_gb"] = self._process.memory_info().rss / 2**30
        return out

    # ---------------------------------------------------------------- alerts

    def _build_sinks(self, run_dir: str, webhook_env: str | None) -> list[Sink]:
        path = alert_log_path(run_dir)
        sinks: list[Sink] = [RunLogSink(path)]
        if self.tracker is not None:
            sinks.append(MlflowSink(self.tracker, path))
        if webhook_env:
            webhook = _webhook_sink(webhook_env)
            if webhook is not None:
                sinks.append(webhook)
        return sinks

    def _emit(self, alert: Alert) -> None:
        from dataclasses import replace

        alert = replace(alert, run=self._run_name, run_id=getattr(self.tracker, "run_id", None))
        self.alerts.append(alert)
        for sink in self.sinks:
            try:
                sink.send(alert)
            except Exception:  # noqa: BLE001 - one sink's outage must not hide the others
                log.exception("alert sink %s failed", type(sink).__name__)
        if alert.severity == "P0" and self.cfg.tracking.alerts.on_p0 == "checkpoint_and_stop":
            self.stop_requested = True
            self.stop_reason = f"P0 alert {alert.rule} at step {alert.step}: {alert.message}"


def _webhook_sink(env_name: str) -> WebhookSink | None:
    """The webhook sink for the URL in $env_name (read here, on rank 0: secrets
    come from the environment only); None, with a logged reason, when unusable."""
    url = os.environ.get(env_name, "").strip()
    if not url:
        log.warning(
            "tracking.alerts.webhook_url_env names $%s, which is not set in this "
            "process's environment: alerts will not be posted",
            env_name,
        )
        return None
    try:
        return WebhookSink(check_webhook_url(url, env_name))
    except UserError as e:
        log.error("alert webhook disabled: %s", e)
        return None


def _this_process() -> Any:
    import psutil

    process = psutil.Process()
    process.cpu_percent(None)  # the first call only sets the baseline
    return process
