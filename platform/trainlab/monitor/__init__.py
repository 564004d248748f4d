"""Monitoring: alert rules over the metric stream, their sinks, and the callback.

`MonitorCallback(cfg, tracker)` is built by `trainlab.track.default_callbacks`.
"""

from trainlab.monitor.callback import MonitorCallback, alert_log_path
from trainlab.monitor.rules import Alert, Rule, build_rules
from trainlab.monitor.sinks import MlflowSink, RunLogSink, WebhookSink

__all__ = [
    "Alert",
    "MlflowSink",
    "MonitorCallback",
    "Rule",
    "RunLogSink",
    "WebhookSink",
    "alert_log_path",
    "build_rules",
]
