"""The rules see every step, not only the logged ones: the loop hands every step's
signals to `on_step_signals` (one step late) and logs every `log_interval`-th.
A single-step spike or NaN between two logged steps fires; healthy noisy runs
fire nothing; alert messages say what the grad norm did before the event.
The P0 decision (every rank) is every non-finite step; the agreed signals are
built from a real (single-process) reduction."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch

from tests.train_helpers import new_run_context
from tests.unit.track.test_monitor_rules import CKPT_EVERY, STEP_SECONDS, Stream
from trainlab.config import load_config
from trainlab.errors import UserError
from trainlab.monitor import MonitorCallback
from trainlab.monitor.rules import build_rules
from trainlab.rayjobs.retry import describe_exit, is_infrastructure_exit
from trainlab.train.job import TrainJob
from trainlab.train.loop.metrics import P0Rules, StepSignals, launch
from trainlab.train.parallel.distributed import DistEnv

RECIPES = Path(__file__).resolve().parents[3] / "trainers" / "recipes"
LOG_INTERVAL = 10
STEPS = 1800


def start(tmp_path: Path, *overrides: str, steps: int = STEPS) -> MonitorCallback:
    cfg = load_config(
        RECIPES / "tiny.yaml",
        [f"train.total_steps={steps + 1}", f"train.log_interval={LOG_INTERVAL}", *overrides],
    )
    clock = {"now": 1_000_000.0}
    monitor = MonitorCallback(cfg, clock=lambda: clock["now"])
    monitor._test_clock = clock  # type: ignore[attr-defined]
    monitor.on_run_start(new_run_context(cfg, tmp_path / "run"))
    return monitor


def drive(stream: Stream, tmp_path: Path, *overrides: str) -> MonitorCallback:
    """The loop's calls: every step's signals, every LOG_INTERVAL-th step's metrics."""
    monitor = start(tmp_path, *overrides)
    rng = random.Random(stream.seed)
    for step in range(1, STEPS + 1):
        monitor._test_clock["now"] += STEP_SECONDS  # type: ignore[attr-defined]
        m = stream.metrics(step, rng)
        signals = {
            "loss": m["loss"],
            "grad_norm": m["grad_norm"],
            "non_finite": float(not math.isfinite(m["loss"])),
            "step_time_s": m["step_time_s"],
            "data_wait_s": 0.001,
        }
        monitor.on_step_signals(step, signals)
        if step % LOG_INTERVAL == 0:
            monitor.on_step_end(step, {**m, "share/code": 0.7, "share/docs": 0.3})
        if step % CKPT_EVERY == 0:
            monitor.on_checkpoint(step, f"ckpt-{step}", True, None)
    monitor.on_run_end({"status": "completed"})
    return monitor


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_noisy_runs_fire_nothing_when_every_step_is_watched(seed, tmp_path):
    monitor = drive(Stream(seed=seed), tmp_path)
    assert monitor.alerts == []


def test_a_single_step_grad_spike_between_logged_steps_fires(tmp_path):
    monitor = drive(Stream(spikes_at={1503}), tmp_path)
    assert [(a.rule, a.step) for a in monitor.alerts] == [("grad_spike", 1503)]
    # the context: the norm was flat before (a data question, not a gradient trend)
    message = monitor.alerts[0].message
    assert "grad norm flat" in message and "look at the data" in message
    assert "code 70%" in message and "docs 30%" in message


def test_a_single_nan_step_between_logged_steps_fires_non_finite(tmp_path):
    monitor = drive(Stream(nan_at={1207}), tmp_path)
    assert [(a.rule, a.step, a.severity) for a in monitor.alerts] == [("non_finite", 1207, "P0")]


def test_a_rising_grad_norm_reads_as_a_gradient_problem(tmp_path):
    monitor = start(tmp_path)
    for step in range(1, 42):  # flat, then rising 1.25x a step, then a spike at 41
        norm = 1.0 if step <= 20 else 1.25 ** (step - 20)
        norm = 1e4 if step == 41 else norm
        monitor.on_step_signals(step, {"loss": 3.0, "grad_norm": norm, "non_finite": 0.0})
    monitor.on_run_end({})
    assert [(a.rule, a.step) for a in monitor.alerts] == [("grad_spike", 41)]
    assert "in the 20 steps before: gradient problem" in monitor.alerts[0].message


def signals(step: int, loss: float, norm: float = 1.0) -> StepSignals:
    bad = int(not (math.isfinite(loss) and math.isfinite(norm)))
    return StepSignals(step, loss, norm, bad, 0.1, 0.0)


def test_the_p0_decision_is_every_non_finite_step_and_nothing_else():
    alerts = load_config(RECIPES / "tiny.yaml", []).tracking.alerts
    rules = P0Rules(alerts, TrainJob.p0_rules)
    decided = [rules.check(signals(s, math.nan if s in (5, 6) else 3.0)) for s in range(1, 10)]
    assert decided == [None] * 4 + ["non_finite"] * 2 + [None] * 3
    assert rules.check(signals(8, 3.0, math.inf)) == "non_finite"
    # a flag from another rank alone (this rank's values finite) is enough
    assert rules.check(StepSignals(9, 3.0, 1.0, 1, 0.1, 0.0)) == "non_finite"
    assert rules.check(signals(10, 3.0, 1e6)) is None  # a spike is P1: alerts only
    p1 = load_config(RECIPES / "tiny.yaml", ["tracking.alerts.non_finite.severity=P1"])
    assert P0Rules(p1.tracking.alerts).check(signals(5, math.nan)) is None


def test_a_rule_configured_as_p0_acts_on_every_rank_at_the_same_step():
    """grad_spike as P0: each rank keeps the same statistics over the agreed
    signals, so all decide at the spiking step (and the monitor alerts there too)."""
    cfg = load_config(RECIPES / "tiny.yaml", ["tracking.alerts.grad_spike.severity=P0"])
    ranks = [P0Rules(cfg.tracking.alerts, TrainJob.p0_rules) for _ in range(2)]
    monitor = MonitorCallback(cfg)
    monitor.rules = build_rules(cfg.tracking.alerts)
    stream = [signals(s, 3.0, 50.0 if s == 12 else 1.0 + 0.01 * (s % 3)) for s in range(1, 16)]
    decided = [[r.check(sig) for sig in stream] for r in ranks]
    for sig in stream:
        monitor.on_step_signals(sig.step, sig.metrics())
    assert decided[0] == decided[1] == [None] * 11 + ["grad_spike"] + [None] * 3
    assert [(a.rule, a.severity, a.step) for a in monitor.alerts] == [("grad_spike", "P0", 12)]


def test_launch_reduces_a_steps_loss_and_flags_into_agreed_signals():
    env = DistEnv()
    ok = launch(env, 7, torch.tensor(2.5), torch.tensor(0.75), 0.2, 0.01).read()
    assert (ok.step, ok.loss, ok.grad_norm, ok.non_finite, ok.bad) == (7, 2.5, 0.75, 0, False)
    bad = launch(env, 8, torch.tensor(math.nan), torch.tensor(0.75), 0.2, 0.01).read()
    assert bad.non_finite == 1 and bad.bad


def test_a_stop_by_alert_is_never_retried_and_bad_p0_config_is_refused():
    assert not is_infrastructure_exit(4) and "not retried" in describe_exit(4)
    cfg = load_config(
        RECIPES / "tiny.yaml",
        [
            "tracking.alerts.on_p0=rollback_and_skip",
            "tracking.alerts.max_rollbacks=2",
            "train.chaos.nan_at_steps=[5]",
            "train.skip_steps=[[3, 4]]",
        ],
    )
    assert cfg.tracking.alerts.on_p0 == "rollback_and_skip"
    assert cfg.train.skip_steps == [(3, 4)]
    with pytest.raises(UserError, match="train.skip_steps"):
        load_config(RECIPES / "tiny.yaml", ["train.skip_steps=[[4, 3]]"])
    with pytest.raises(UserError, match="on_p0"):
        load_config(RECIPES / "tiny.yaml", ["tracking.alerts.on_p0=panic"])


def test_gpu_metrics_per_device_through_nvml(monkeypatch):
    """The NVML code path, with a stand-in `pynvml` module (no GPU here): one
    util and one memory metric per device; without the package, nothing."""
    import types

    from trainlab.monitor.gpu import GpuMetrics

    monkeypatch.setitem(sys.modules, "pynvml", None)  # the extra not installed
    assert GpuMetrics().read() == {}
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=40 + h),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=(h + 1) * 2**30),
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    gpu = GpuMetrics()
    assert gpu.read() == {
        "gpu0/util_pct": 40.0,
        "gpu0/mem_gb": 1.0,
        "gpu1/util_pct": 41.0,
        "gpu1/mem_gb": 2.0,
    }
    gpu.close()
    assert gpu.read() == {}
