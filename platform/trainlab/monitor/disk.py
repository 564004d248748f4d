"""low_disk: a P1 alert when the run directory's filesystem runs short of space.

The preflight (`trainlab.nodedisk.check_disk_room`) refuses a run that cannot hold
its checkpoints when it starts; this rule covers what happens after: other runs,
logs or datasets filling the same disk while the run trains. A checkpoint written
to a full disk fails, and with it the run, so the alert comes while there is
still time to free space (`trainlab gc`) or move runs_root.

Statistic: free bytes of the filesystem holding the run directory (`statvfs`,
what `df` shows as available to unprivileged users), measured on every logged
step, against `tracking.alerts.low_disk.min_free_gb`. The shared `Rule.observe`
gives it the window, latch and cool-down of the other rules.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainlab.monitor.rules import Rule, Verdict

GIB = 2**30


def free_bytes(path: str) -> int:
    """Bytes available on the filesystem holding `path`."""
    return shutil.disk_usage(path).free


@dataclass
class LowDisk(Rule):
    path: str = ""
    min_free_bytes: int = 5 * GIB
    measure: Callable[[str], int] = field(default=free_bytes, repr=False)

    def judge(self, step: int, metrics: dict[str, float], now: float) -> Verdict | None:
        try:
            free = self.measure(self.path)
        except OSError:  # the directory went away: nothing to judge
            return None
        return Verdict(
            free < self.min_free_bytes,
            free / GIB,
            f"{free / GIB:.2f} GiB free on the filesystem of {self.path} (alert below "
            f"{self.min_free_bytes / GIB:g} GiB): the next checkpoints may not fit; free "
            "space (trainlab gc) or lower train.checkpoint.keep_last",
        )


def low_disk_rules(alerts: Any, run_dir: str) -> list[Rule]:
    """The low_disk rule of `tracking.alerts` (an AlertsConfig) for `run_dir`."""
    c = getattr(alerts, "low_disk", None)
    if c is None:
        return []
    return [
        LowDisk(
            name="low_disk",
            severity=c.severity,
            window=c.window,
            cooldown=c.cooldown,
            enabled=c.enabled,
            path=str(run_dir),
            min_free_bytes=int(c.min_free_gb * GIB),
        )
    ]
