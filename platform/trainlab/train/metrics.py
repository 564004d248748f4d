"""What rank 0 reports at each log interval: throughput over the window since
the last log line, memory, MFU, data shares, ETA; and the run's steady-state
throughput (every window but an attempt's first, which holds the warm-up)."""

from __future__ import annotations

import os
import resource
import statistics
import time
from dataclasses import dataclass, field

import torch

from trainlab.config.schema import ExperimentConfig
from trainlab.train.schedule import lr_at


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
    started: float = field(default_factory=time.perf_counter)
    windows: int = 0
    steady_tokens: int = 0
    steady_seconds: float = 0.0
    window_rates: list[float] = field(default_factory=list)

    def reset(self) -> None:
        self.steps, self.step_time, self.data_wait = 0, 0.0, 0.0
        self.started = time.perf_counter()

    def record(self, data_wait: float, step_time: float) -> None:
        self.steps += 1
        self.data_wait += data_wait
        self.step_time += step_time

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
            "step_time_s": step_time,
            "data_wait_frac": self.data_wait / elapsed,
            "mem_gb": mem,
            "mem_peak_gb": mem_peak,
            "ckpt_age_s": ckpt_age_s,
            "eta_s": step_time * (self.cfg.train.total_steps - step),
        }
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
