"""Alert rules on synthetic metric streams: noisy but healthy curves fire nothing;
each injected anomaly fires exactly its own rule, once (hysteresis, cool-down).

Streams are driven through the real MonitorCallback with the loop's metric keys,
at two logging intervals, with an injected clock (2 s per step)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.train_helpers import new_run_context
from tests.unit.track.conftest import RECIPES
from trainlab.config import load_config
from trainlab.monitor import MonitorCallback

STEPS = 2400
STEP_SECONDS = 2.0
CKPT_EVERY = 100


@dataclass
class Stream:
    """A healthy run: decaying loss that flattens into a long noisy plateau, lognormal
    grad norms, throughput with 8% noise and a one-step dip at every checkpoint save,
    valid checkpoints every CKPT_EVERY steps. Anomalies edit it per step."""

    seed: int = 0
    nan_at: set[int] = field(default_factory=set)
    rise_from: int | None = None  # loss climbs 0.02/step for 200 steps from here
    spikes_at: set[int] = field(default_factory=set)
    slow_from: int | None = None  # throughput at 30% for 100 steps from here
    ckpt_invalid_from: int | None = None

    def metrics(self, step: int, rng: random.Random) -> dict[str, float]:
        loss = 2.0 + 7.0 * math.exp(-step / 150) + rng.gauss(0, 0.05)
        if self.rise_from is not None and step >= self.rise_from:
            loss += 0.02 * min(step - self.rise_from, 200)
        if step in self.nan_at:
            loss = math.nan
        grad = (1 + 2 * math.exp(-step / 100)) * math.exp(rng.gauss(0, 0.3))
        if step in self.spikes_at:
            grad *= 60
        tps = 5000 * (1 + rng.gauss(0, 0.08))
        if step % CKPT_EVERY == 1:
            tps *= 0.3  # the step after a checkpoint save is slow
        if self.slow_from is not None and self.slow_from <= step < self.slow_from + 100:
            tps *= 0.3
        return {
            "loss": loss,
            "lr": 1e-3,
            "grad_norm": grad,
            "tokens_per_s": tps,
            "step_time_s": 0.1,
            "data_wait_frac": 0.01,
            "mem_gb": 1.0,
            "mem_peak_gb": 1.2,
        }

    def checkpoint_valid(self, step: int) -> bool:
        return self.ckpt_invalid_from is None or step < self.ckpt_invalid_from


def run_stream(
    stream: Stream, log_interval: int, tmp_path: Path, *overrides: str, steps: int = STEPS
) -> MonitorCallback:
    cfg = load_config(
        RECIPES / "tiny.yaml",
        [f"train.total_steps={steps + 1}", f"train.log_interval={log_interval}", *overrides],
    )
    clock = {"now": 1_000_000.0}
    monitor = MonitorCallback(cfg, clock=lambda: clock["now"])
    monitor.on_run_start(new_run_context(cfg, tmp_path / "run"))
    rng = random.Random(stream.seed)
    for step in range(1, steps + 1):
        clock["now"] += STEP_SECONDS
        metrics = stream.metrics(step, rng)  # every step draws, logged or not
        if step % log_interval == 0:
            monitor.on_step_end(step, metrics)
        if step % CKPT_EVERY == 0:
            monitor.on_checkpoint(step, f"ckpt-{step}", stream.checkpoint_valid(step), None)
    monitor.on_run_end({"status": "completed"})
    return monitor


def fired(monitor: MonitorCallback) -> list[str]:
    return [a.rule for a in monitor.alerts]


INTERVALS = [1, 10]


@pytest.mark.parametrize("log_interval", INTERVALS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_but_healthy_runs_fire_nothing(log_interval, seed, tmp_path):
    monitor = run_stream(Stream(seed=seed), log_interval, tmp_path)
    assert fired(monitor) == []
    assert not (tmp_path / "run" / "logs" / "alerts.jsonl").exists()


ANOMALIES = {
    "non_finite": Stream(nan_at={1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008, 1009, 1010}),
    "loss_rising": Stream(rise_from=1200),
    "grad_spike": Stream(spikes_at={1500, 1501, 1502}),
    "throughput_drop": Stream(slow_from=1300),
    "stale_checkpoint": Stream(ckpt_invalid_from=1000),
}


@pytest.mark.parametrize("log_interval", INTERVALS)
@pytest.mark.parametrize("rule", sorted(ANOMALIES))
def test_each_anomaly_fires_exactly_its_rule_once(rule, log_interval, tmp_path):
    stream = ANOMALIES[rule]
    if rule == "grad_spike" and log_interval == 10:
        stream = Stream(spikes_at={1500, 1510, 1520})  # a burst the sparse log sees
    monitor = run_stream(stream, log_interval, tmp_path)
    assert fired(monitor) == [rule]


def test_alert_fields_and_the_run_log(tmp_path):
    monitor = run_stream(ANOMALIES["non_finite"], 1, tmp_path)
    (alert,) = monitor.alerts
    assert (alert.rule, alert.severity, alert.step) == ("non_finite", "P0", 1000)
    assert alert.run == "tiny" and "loss is nan" in alert.message
    assert math.isnan(alert.value) and alert.to_json()["value"] == "nan"
    lines = (tmp_path / "run" / "logs" / "alerts.jsonl").read_text().splitlines()
    assert len(lines) == 1 and '"rule": "non_finite"' in lines[0]


class ShortDip(Stream):
    """Throughput at 30% for 15 steps only: shorter than the 20-step window."""

    def metrics(self, step, rng):
        m = super().metrics(step, rng)
        if 1300 <= step < 1315:
            m["tokens_per_s"] *= 0.3
        return m


def test_window_a_short_dip_does_not_fire_throughput_drop(tmp_path):
    assert fired(run_stream(ShortDip(), 1, tmp_path)) == []
    assert fired(run_stream(Stream(slow_from=1300), 1, tmp_path)) == ["throughput_drop"]


def test_cooldown_and_rearm(tmp_path):
    # Two separate spikes 50 steps apart: the second falls in the 100-step cool-down.
    assert fired(run_stream(Stream(spikes_at={1500, 1550}), 1, tmp_path)) == ["grad_spike"]
    # 300 steps apart: a second, separate episode fires again.
    assert fired(run_stream(Stream(spikes_at={1500, 1800}), 1, tmp_path)) == [
        "grad_spike",
        "grad_spike",
    ]
    # With no cool-down, one NaN episode still fires once (latched until it clears) ...
    nan_burst = Stream(nan_at=set(range(1000, 1020)))
    assert fired(run_stream(nan_burst, 1, tmp_path, "tracking.alerts.non_finite.cooldown=0")) == [
        "non_finite"
    ]
    # ... and a NaN after it cleared is a new episode.
    two = Stream(nan_at={1000, 1010})
    assert fired(run_stream(two, 1, tmp_path, "tracking.alerts.non_finite.cooldown=0")) == [
        "non_finite",
        "non_finite",
    ]


def test_disabled_rule_and_configured_severity(tmp_path):
    quiet = run_stream(
        ANOMALIES["grad_spike"], 1, tmp_path, "tracking.alerts.grad_spike.enabled=false"
    )
    assert fired(quiet) == []
    loud = run_stream(
        ANOMALIES["grad_spike"], 1, tmp_path, "tracking.alerts.grad_spike.severity=P0"
    )
    assert [a.severity for a in loud.alerts] == ["P0"]


def test_p0_checkpoint_and_stop_requests_a_stop(tmp_path):
    notify = run_stream(ANOMALIES["non_finite"], 1, tmp_path)
    assert not notify.stop_requested
    stop = run_stream(
        ANOMALIES["non_finite"],
        1,
        tmp_path,
        "tracking.alerts.on_p0=checkpoint_and_stop",
        steps=1005,
    )
    assert stop.stop_requested
    assert "non_finite at step 1000" in stop.stop_reason
    # P1 alerts never stop a run.
    p1 = run_stream(
        ANOMALIES["grad_spike"], 1, tmp_path, "tracking.alerts.on_p0=checkpoint_and_stop"
    )
    assert fired(p1) == ["grad_spike"] and not p1.stop_requested


def test_stale_checkpoint_uses_the_loops_checkpoint_age_when_reported(tmp_path):
    cfg = load_config(RECIPES / "tiny.yaml", ["tracking.alerts.stale_checkpoint.minutes=1"])
    monitor = MonitorCallback(cfg, clock=lambda: 0.0)  # the clock never moves
    monitor.on_run_start(new_run_context(cfg, tmp_path))
    for step, age in [(5, 10.0), (10, 50.0), (15, 70.0), (20, 80.0), (25, 5.0), (30, 90.0)]:
        monitor.on_step_end(step, {"loss": 3.0, "ckpt_age_s": age})
    assert [(a.rule, a.step) for a in monitor.alerts] == [("stale_checkpoint", 15)]
