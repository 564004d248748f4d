"""The monitoring callback: signals as metrics, alert rules, sinks, and the P0 action.

Signals, logged as metrics beside the loop's own:
- health: loss, grad_norm, tokens_per_s (from the loop);
- resources: mem_gb (loop), cpu_util_pct and rss_gb of the rank-0 process (here),
  gpu<i>/util_pct and gpu<i>/mem_gb of rank 0's node through NVML (the `gpu`
  extra, monitor.gpu), plus MLflow's system metrics (CPU, memory, GPU when present);
- progress: step, progress (fraction of train.total_steps), eta_s and ckpt_age_s
  (from the loop when it reports them, else computed here);
- alerts_fired: alerts so far in this process, so alerts sit on the curves.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainlab.errors import UserError
from trainlab.monitor.disk import low_disk_rules
from trainlab.monitor.gpu import GpuMetrics
from trainlab.monitor.rules import STEP_RULES, Alert, Rule, StaleCheckpoint, build_rules
from trainlab.monitor.sinks import (
    CommandSink,
    MlflowSink,
    RunLogSink,
    Sink,
    WebhookSink,
    check_webhook_url,
)
from trainlab.run.location import RunLocation
from trainlab.train.loop.callbacks import Callback, RunContext

log = logging.getLogger(__name__)

# Alert context: the grad-norm trend over this many steps before the event; a
# rise by TREND_RISE x or more reads as a gradient problem.
TREND_STEPS = 20
TREND_RISE = 3.0
# The default hooks' variables (trainlab.config.schema): unset ones are only noted.
_DEFAULT_HOOK_ENV = {"page": "TRAINLAB_PAGE_WEBHOOK", "message": "TRAINLAB_MESSAGE_WEBHOOK"}


def alert_log_path(run_dir: str | Path) -> Path:
    """The run's alert log: one JSON object per alert, appended across restarts
    (in this node's directory of the run; a run in object storage ships it there
    with its other logs, trainlab.run.location.ship_logs)."""
    return RunLocation.of(run_dir).local / "logs" / "alerts.jsonl"


class MonitorCallback(Callback):
    """Evaluates the alert rules and fans alerts out to the sinks: the per-step rules
    (non_finite, loss_rising, grad_spike) on every step's signals, the others on
    every logged step. P0 actions are the loop's (trainlab.train.loop.metrics.P0Rules).

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
        self.routes: dict[str, list[Sink]] = {}
        self._run_name = cfg.name
        self._start = (0, 0.0)  # (step, time) of this process's start
        self._process: Any = None
        self._gpu: GpuMetrics | None = None
        self._norms: deque[tuple[int, float]] = deque(maxlen=TREND_STEPS)
        self._shares: dict[str, float] = {}
        self.rollbacks: list[dict[str, Any]] = []
        self._per_step = False  # the loop feeds every step's signals (on_step_signals)
        self._say_unusable = True  # name the hooks that cannot post (once per run)
        self._said_unusable = False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["sinks"], state["routes"], state["_process"], state["_gpu"] = [], {}, None, None
        return state

    # ---------------------------------------------------------------- hooks

    def on_run_start(self, ctx: RunContext) -> None:
        # After an in-place restart the rules start afresh (throughput and loss
        # statistics restart with the processes); alerts so far are kept.
        self.on_run_end({})
        alerts_cfg = ctx.cfg.tracking.alerts
        local = RunLocation.of(ctx.run_dir).local  # a run in object storage: its scratch copy
        self.rules = [*build_rules(alerts_cfg), *low_disk_rules(alerts_cfg, str(local))]
        now = self.clock()
        for rule in self.rules:
            if isinstance(rule, StaleCheckpoint):
                rule.start(now)
        self._start = (ctx.start_step, now)
        # Which hooks cannot post is said on the run's first start only (restarts,
        # in place or of the worker group, and resumes would repeat it).
        self._say_unusable = ctx.restarts == 0 and not self._said_unusable
        self.sinks, self.routes = self._build_sinks(ctx.run_dir, alerts_cfg)
        self._said_unusable = True
        self._process = _this_process()
        self._gpu = GpuMetrics()

    def on_step_signals(self, step: int, signals: dict[str, float]) -> None:
        """Every step (one step late): the per-step rules see every step, not only
        the logged ones."""
        now = self.clock()
        for rule in self.rules:
            if rule.name in STEP_RULES:
                alert = rule.observe(step, signals, now)
                if alert is not None:
                    self._emit(replace(alert, message=f"{alert.message}; {self._trend(step)}"))
        norm = signals.get("grad_norm")
        if norm is not None and math.isfinite(norm):
            self._norms.append((step, float(norm)))
        self._per_step = True

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        now = self.clock()
        signals = self.signals(step, metrics, now)
        observed = {**signals, **metrics}
        self._shares = {k: v for k, v in metrics.items() if k.startswith("share/")}
        for rule in self.rules:
            if rule.name in STEP_RULES and self._per_step:
                continue  # judged every step by on_step_signals
            alert = rule.observe(step, observed, now)
            if alert is not None:
                if rule.name == "throughput_drop":
                    alert = replace(alert, message=f"{alert.message}; {_time_split(metrics)}")
                self._emit(alert)
                if not self._per_step:
                    self._request_stop(alert)
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
        sinks, self.sinks, self.routes = self.sinks, [], {}
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
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
        if self._gpu is not None:
            out.update(self._gpu.read())
        return out

    # ---------------------------------------------------------------- alerts

    def _build_sinks(
        self, run_dir: str, alerts_cfg: Any
    ) -> tuple[list[Sink], dict[str, list[Sink]]]:
        """Every destination's sink, and the sinks of each severity
        (tracking.alerts.routes); a hook that cannot deliver is left out, logged."""
        path = alert_log_path(run_dir)
        named: dict[str, Sink] = {"log": RunLogSink(path)}
        if self.tracker is not None:
            named["mlflow"] = MlflowSink(self.tracker, path)
        used = {n for names in alerts_cfg.routes.values() for n in names}
        for name, hook in alerts_cfg.hooks.items():
            if name not in used:
                continue
            sink: Sink | None
            if hook.command:
                sink = CommandSink(hook.command)
            else:
                env = hook.webhook_url_env
                if name == "message" and alerts_cfg.webhook_url_env:
                    env = alerts_cfg.webhook_url_env
                sink = _webhook_sink(
                    env, name, explicit=env != _DEFAULT_HOOK_ENV.get(name), say=self._say_unusable
                )
            if sink is not None:
                named[name] = sink
        routes = {
            severity: [named[n] for n in names if n in named]
            for severity, names in alerts_cfg.routes.items()
        }
        return list(named.values()), routes

    def _emit(self, alert: Alert) -> None:
        alert = replace(alert, run=self._run_name, run_id=getattr(self.tracker, "run_id", None))
        self.alerts.append(alert)
        for sink in self.routes.get(alert.severity, []):
            try:
                sink.send(alert)
            except Exception:  # noqa: BLE001 - one sink's outage must not hide the others
                log.exception("alert sink %s failed", type(sink).__name__)

    def _request_stop(self, alert: Alert) -> None:
        """For a loop that feeds no per-step signals (the trainer's own loop does,
        and takes P0 actions itself on every rank): stop at the next log step."""
        if alert.severity == "P0" and self.cfg.tracking.alerts.on_p0 == "checkpoint_and_stop":
            self.stop_requested = True
            self.stop_reason = f"P0 alert {alert.rule} at step {alert.step}: {alert.message}"

    def on_rollback(self, record: dict[str, Any]) -> None:
        """Recorded on the MLflow run (a tag per rollback and a `rollbacks` count)."""
        self.rollbacks.append(record)
        log.warning(
            "rolled back from step %d to step %d, skipping steps %d-%d (%s)",
            record["from_step"],
            record["to_step"],
            *record["skipped"],
            record["rule"],
        )
        if self.tracker is not None:
            n = len(self.rollbacks)
            self.tracker.set_tags({f"rollback.{n}": json.dumps(record), "rollbacks": str(n)})
            self.tracker.log_metrics(record["from_step"], {"rollbacks": float(n)})

    def _trend(self, step: int) -> str:
        """The grad norm over the TREND_STEPS steps before `step`: a gradient problem
        shows as a rising norm, a data problem as a flat one."""
        before = [v for s, v in self._norms if step - TREND_STEPS <= s < step]
        shares = ", ".join(f"{k[6:]} {v:.0%}" for k, v in sorted(self._shares.items()))
        where = f"; source shares so far: {shares}" if shares else ""
        if len(before) < 2:
            return f"no grad norm history before step {step}{where}"
        head = max(min(before[: len(before) // 2 or 1]), 1e-12)
        tail = max(before[len(before) // 2 :])
        ratio = tail / head
        verdict = (
            f"grad norm rose {ratio:.1f}x in the {len(before)} steps before: gradient problem"
            if ratio >= TREND_RISE
            else f"grad norm flat ({ratio:.1f}x) in the {len(before)} steps before: "
            "look at the data (trainlab data at-step)"
        )
        return verdict + where


def _time_split(metrics: dict[str, float]) -> str:
    """Where a logged window's time went: data wait, checkpoint blocking, compute."""
    wait = metrics.get("data_wait_frac")
    ckpt = metrics.get("ckpt_block_frac", 0.0)
    if wait is None:
        return "no time split available"
    compute = max(0.0, 1.0 - wait - ckpt)
    return (
        f"time split: data wait {wait:.0%}, checkpoint blocking {ckpt:.0%}, compute {compute:.0%}"
    )


def _webhook_sink(
    env_name: str, hook: str, explicit: bool = True, say: bool = True
) -> WebhookSink | None:
    """The webhook sink for the URL in $env_name (read here, on rank 0: secrets
    come from the environment only); None when unusable, with the reason logged
    when `say` (a warning when the config named the variable, else a note: the
    default hooks are unset on most machines)."""
    url = os.environ.get(env_name, "").strip()
    if not url:
        if not say:
            return None
        log.log(
            logging.WARNING if explicit else logging.INFO,
            "alert hook %r: $%s is not set in this process's environment: its "
            "alerts will not be posted",
            hook,
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
