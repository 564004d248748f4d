"""Where the CPU goes during a benchmarked run: CPU seconds per part of the
process tree under this process (the embedded Ray cluster's daemons, Ray Train's
controller, trainlab's agents and training processes, Ray Data's tasks, this
driver).

A background thread samples every process in the tree (`psutil`) every
`interval_s` and keeps each one's newest cumulative user+system time; a process
that ends between two samples loses at most that interval. Processes of other
Ray clusters on the machine are not descendants of this one and are not counted.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import psutil

# Ray's daemons by process name or command line.
RAY_DAEMONS = ("raylet", "gcs_server")
RAY_SERVICES = ("dashboard", "runtime_env", "log_monitor", "monitor.py", "autoscaler")


class CpuSplit:
    """Context manager: `with CpuSplit() as split: run(...)`; then `split.seconds()`."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self._root = psutil.Process(os.getpid())
        self._start: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-split", daemon=True)

    def __enter__(self) -> CpuSplit:
        for p, cpu in self._sample():
            self._start[p.pid] = cpu
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> list[tuple[psutil.Process, float]]:
        seen = []
        for p in [self._root, *self._root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                cpu = t.user + t.system
                # Re-read each time: a Ray worker starts as `python .../default_worker.py`
                # or `ray::IDLE` and takes its actor's title later; the last one wins.
                self._roles[p.pid] = role(p, self._root.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            self._last[p.pid] = cpu
            seen.append((p, cpu))
        return seen

    def seconds(self) -> dict[str, float]:
        """CPU seconds per part over the `with` block, largest first."""
        out: dict[str, float] = {}
        for pid, cpu in self._last.items():
            used = cpu - self._start.get(pid, 0.0)
            out[self._roles[pid]] = out.get(self._roles[pid], 0.0) + used
        return dict(sorted(((k, round(v, 2)) for k, v in out.items()), key=lambda kv: -kv[1]))


def role(p: psutil.Process, driver_pid: int) -> str:
    """The part of the run a process is."""
    if p.pid == driver_pid:
        return "driver (this process: trainlab.train.run, Ray client)"
    name, cmd = p.name(), " ".join(p.cmdline())
    if name in RAY_DAEMONS:
        return f"ray daemon: {name}"
    if any(s in cmd for s in RAY_SERVICES):
        return "ray services: dashboard, its agents, log monitor"
    if cmd.startswith("ray::RayTrainWorker"):
        return "trainlab agent (Ray Train worker: loader client, callbacks)"
    if cmd.startswith("ray::TrainController"):
        return "ray train controller"
    for parent in p.parents():
        if " ".join(parent.cmdline()).startswith("ray::RayTrainWorker"):
            return "trainlab training process (fork server + child: model step)"
    if cmd.startswith("ray::"):
        return "other ray workers (Ray Data tasks and actors, idle workers)"
    return f"other: {name}"
