"""What rank 0 reports at each log interval: throughput over the window since
the last log line, memory, MFU, data shares, ETA; and the run's steady-state
throughput (every window but an attempt's first, which holds the warm-up);
and every step's health signals, read one step late (below)."""

from __future__ import annotations

import math
import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from trainlab.config.schema import ExperimentConfig
from trainlab.train.loop.schedule import lr_at


def memory_gb(device: torch.device) -> tuple[float, float]:
    """(current, peak) memory of this process in GB: device memory on GPU,
    resident set size on CPU."""
    peak = peak_memory_bytes(device) / 1e9
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 1e9, peak
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        current = peak
    return current, peak


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated device memory on GPU, the resident set
    size on CPU (which also holds the interpreter, torch's libraries and the
    data pipeline's buffers, none of which the plan counts)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux


def memory_gap(planned: float | None, measured: float | None) -> str | None:
    """ "estimate 61.5 GiB, measured 58.0 GiB: -6%" (the measurement relative to
    the estimate), or None when either is unknown."""
    if not planned or not measured:
        return None
    gib = 1024**3
    return (
        f"estimate {planned / gib:.2f} GiB, measured {measured / gib:.2f} GiB: "
        f"{100 * (measured / planned - 1):+.0f}%"
    )


@dataclass
class Meter:
    """Step timings of the current log window and the run's steady throughput."""

    cfg: ExperimentConfig
    world_size: int
    device: torch.device
    flops_per_token: float = 0.0
    steps: int = 0
    step_time: float = 0.0
    data_wait: float = 0.0
    ckpt_block: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    windows: int = 0
    steady_tokens: int = 0
    steady_seconds: float = 0.0
    window_rates: list[float] = field(default_factory=list)
    # Metrics said once, in the next window (the first step's compile time).
    once: dict[str, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.steps, self.step_time, self.data_wait, self.ckpt_block = 0, 0.0, 0.0, 0.0
        self.started = time.perf_counter()

    def record(self, data_wait: float, step_time: float) -> None:
        self.steps += 1
        self.data_wait += data_wait
        self.step_time += step_time

    def record_checkpoint(self, blocked: float) -> None:
        """Seconds the loop waited on a checkpoint save (the window's third time share)."""
        self.ckpt_block += blocked

    def window(
        self, step: int, loss: float, grad_norm: float, ckpt_age_s: float
    ) -> dict[str, float]:
        """The metrics of the window ending at `step` (`reset` starts the next)."""
        tokens_per_step = self.cfg.tokens_per_step
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        tokens_per_s = tokens_per_step * self.steps / elapsed
        step_time = self.step_time / max(self.steps, 1)
        mem, mem_peak = memory_gb(self.device)
        metrics = {
            "loss": float(loss),
            "lr": lr_at(step - 1, self.cfg.train),
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            # Per device and the device count: an elastic run's resize is not a
            # throughput regression on a chart of these (docs/elastic.md).
            "tokens_per_s_per_device": tokens_per_s / self.world_size,
            "world_size": float(self.world_size),
            "step_time_s": step_time,
            "data_wait_frac": self.data_wait / elapsed,
            "ckpt_block_frac": self.ckpt_block / elapsed,
            "mem_gb": mem,
            "mem_peak_gb": mem_peak,
            "ckpt_age_s": ckpt_age_s,
            "eta_s": step_time * (self.cfg.train.total_steps - step),
        }
        metrics.update(self.once)
        self.once = {}
        peak = self.cfg.resource.peak_tflops
        if peak and self.flops_per_token:
            metrics["mfu"] = self.flops_per_token * tokens_per_s / (peak * 1e12 * self.world_size)
        if self.windows:
            self.steady_tokens += tokens_per_step * self.steps
            self.steady_seconds += elapsed
            self.window_rates.append(tokens_per_s)
        self.windows += 1
        return metrics

    def steady_throughput(self) -> tuple[float | None, float | None]:
        """(tokens/s over the steady windows, median of their rates): the median is
        robust to a few windows slowed by something else on the machine."""
        mean = self.steady_tokens / self.steady_seconds if self.steady_seconds else None
        median = statistics.median(self.window_rates) if self.window_rates else None
        return mean, median


def progress_line(step: int, total: int, m: dict[str, float]) -> str:
    return (
        f"step {step}/{total} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | "
        f"{m['tokens_per_s']:,.0f} tok/s | step {m['step_time_s']:.3f} s | "
        f"data {100 * m['data_wait_frac']:.1f}% | eta {duration(m['eta_s'])}"
    )


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


# --------------------------------------------------------------------------- every step's health
#
# Each optimizer step leaves its loss and gradient norm (before clipping) on the
# device. `launch` puts them, with this rank's non-finite flag, into one small
# all-reduce (replicas' loss summed, non-finite flags summed over the world) and
# starts an asynchronous copy to the host; the loop reads it (`PendingSignals.read`)
# after the *next* step has been queued, so on a GPU the host waits only for that
# copy, never for the step in flight: no per-step device-to-host sync. The reduced
# values are the same on every rank, so a P0 decision taken from them
# (`P0Rules`) is the same on every rank at the same step, never rank 0's alone.


# Rank 0's request, carried with every step's signals (launch): none; hold at the
# step it is read, after a checkpoint, for an elastic run to grow
# (trainlab.train.loop.growth); stop there; or stop there with a checkpoint. A
# larger value wins over a smaller one: a stop over a hold.
NO_STOP, HOLD, STOP, STOP_AND_SAVE = 0, 1, 2, 3


@dataclass(frozen=True)
class StepSignals:
    """One optimizer step's health, as every rank sees it."""

    step: int  # 1-based: the number of updates done after this step
    loss: float  # mean over the step's labelled tokens of all replicas
    grad_norm: float  # global, before clipping
    non_finite: int  # ranks whose loss or grad norm was NaN/inf
    step_time_s: float  # this rank's host time for the step (queueing time on a GPU)
    data_wait_s: float  # this rank's wait for the step's batch
    # Rank 0's request at this step (a Ctrl-C, a callback, a growth): NO_STOP, HOLD,
    # STOP or STOP_AND_SAVE; every rank acts alike when it reads one.
    stop: int = 0

    @property
    def bad(self) -> bool:
        """Some rank saw a non-finite loss or grad norm at this step."""
        return self.non_finite > 0 or not (
            math.isfinite(self.loss) and math.isfinite(self.grad_norm)
        )

    def describe(self) -> str:
        return (
            f"loss {self.loss:.4g}, grad norm {self.grad_norm:.4g} at step {self.step} "
            f"(non-finite on {self.non_finite} rank(s))"
        )

    def metrics(self) -> dict[str, float]:
        return {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "non_finite": float(self.non_finite),
            "step_time_s": self.step_time_s,
            "data_wait_s": self.data_wait_s,
        }


class PendingSignals:
    """A step's signals on their way to the host (see the module docstring)."""

    def __init__(
        self,
        step: int,
        values: torch.Tensor,
        dp_size: int,
        step_time_s: float,
        data_wait_s: float,
    ):
        self.step, self.dp_size = step, dp_size
        self.step_time_s, self.data_wait_s = step_time_s, data_wait_s
        self._event: Any = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values

    def read(self) -> StepSignals:
        if self._event is not None:
            self._event.synchronize()
        loss_sum, non_finite, stop = self._host.tolist()[:3]
        grad_norm = float(self._host[3].item())
        return StepSignals(
            step=self.step,
            loss=loss_sum / self.dp_size,
            grad_norm=grad_norm,
            non_finite=int(non_finite) if math.isfinite(non_finite) else 1,
            step_time_s=self.step_time_s,
            data_wait_s=self.data_wait_s,
            stop=int(stop),
        )


def launch(
    env: Any,
    step: int,
    loss: torch.Tensor,
    grad_norm: torch.Tensor,
    step_time_s: float,
    data_wait_s: float,
    stop: int = NO_STOP,
) -> PendingSignals:
    """Reduce step `step`'s loss and flags across ranks (queued, not waited for).
    `stop` is rank 0's stop request (other ranks pass NO_STOP): the sum is rank 0's."""
    loss64 = loss.detach().to(torch.float64).reshape(())
    norm64 = grad_norm.detach().to(torch.float64).reshape(())
    bad = (~torch.isfinite(loss64) | ~torch.isfinite(norm64)).to(torch.float64)
    owned = loss64 if env.owns_loss else torch.zeros_like(loss64)
    asked = torch.full_like(loss64, float(stop))  # a fill on the device: no host copy
    reduced = env.all_reduce_sum(torch.stack([owned, bad, asked]))
    # The norm is global already (the same number on every rank): carried, not reduced.
    values = torch.cat([reduced, norm64.reshape(1)])
    return PendingSignals(step, values, env.dp_size, step_time_s, data_wait_s)


class P0Rules:
    """The P0 rules whose action (tracking.alerts.on_p0) the run takes, judged on
    every rank from the same all-reduced signals, so every rank decides alike at
    the same step: non_finite from the ranks' flags; the per-step statistical rules
    (loss_rising, grad_spike when configured as P0) from the agreed loss and global
    grad norm, each rank keeping the same statistics. Those rules are the monitor's
    own (the same code rank 0 runs to send the alert), given by import path
    (`TrainJob.p0_rules`: the training layer imports no monitoring code). Rules
    over per-rank clocks or rank 0's own measurements (throughput, checkpoint age,
    disk) alert but never act."""

    def __init__(
        self, alerts: Any, factories: tuple[str, ...] = (), router: tuple[str, ...] = ()
    ):
        from trainlab.train.loop.callbacks import load_factory

        self.alerts = alerts
        self.rules = [rule for path in factories for rule in load_factory(path)(alerts)]
        # An MoE's router rules (router_collapse, expert_imbalance as P0), judged from
        # the router metrics of each logged step: the same on every rank.
        self.router_rules = [rule for path in router for rule in load_factory(path)(alerts)]

    def check_router(self, step: int, metrics: dict[str, float]) -> str | None:
        """The router rule that fires at logged step `step`, or None."""
        fired = None
        for r in self.router_rules:
            if r.observe(step, metrics, 0.0) is not None and fired is None:
                fired = r.name
        return fired

    def check(self, signals: StepSignals) -> str | None:
        """The rule that fires at this step, or None."""
        rule = self.alerts.non_finite
        if signals.bad:
            return "non_finite" if rule.enabled and rule.severity == "P0" else None
        fired, metrics = None, signals.metrics()
        for r in self.rules:  # every rule sees every step, as the monitor's do
            if r.observe(signals.step, metrics, 0.0) is not None and fired is None:
                fired = r.name
        return fired
