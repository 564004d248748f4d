"""What a mixture law predicts: a held-out loss a run records, or a weighted sum.

TARGET is `val_loss` (the run's loss over every mixed source's held-out split),
`val_loss/SOURCE`, or a weighted combination `0.5*val_loss/code+0.5*val_loss/docs`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from trainlab.errors import UserError

_METRIC = re.compile(r"^val_loss(/[A-Za-z0-9_.\-]+)?$")


@dataclass(frozen=True)
class Target:
    """A linear combination of recorded held-out losses."""

    text: str
    terms: tuple[tuple[float, str], ...]  # (weight, metric)

    def value(self, metrics: dict[str, float | None]) -> float | None:
        """The target of one trial from its metrics ({"val_loss": .., "val_loss/code": ..});
        None when a term was not recorded (e.g. a source that was not mixed)."""
        total = 0.0
        for weight, metric in self.terms:
            v = metrics.get(metric)
            if v is None or not math.isfinite(float(v)):
                return None
            total += weight * float(v)
        return total

    @property
    def sources(self) -> list[str]:
        return [m.split("/", 1)[1] for _, m in self.terms if "/" in m]


def parse_target(text: str, sources: list[str] | None = None) -> Target:
    """`val_loss`, `val_loss/SOURCE` or `W*METRIC+W*METRIC...`; UserError naming the bad part."""
    terms: list[tuple[float, str]] = []
    for part in text.replace(" ", "").split("+"):
        weight_text, star, metric = part.rpartition("*")
        if not star:
            weight_text, metric = "1", part
        try:
            weight = float(weight_text)
        except ValueError:
            raise UserError(f"--target {text!r}: {weight_text!r} is not a number") from None
        if not _METRIC.match(metric):
            raise UserError(f"--target {text!r}: {metric!r} is not val_loss or val_loss/SOURCE")
        if not math.isfinite(weight) or weight <= 0:
            raise UserError(f"--target {text!r}: weight {weight_text} must be > 0")
        if sources is not None and "/" in metric and metric.split("/", 1)[1] not in sources:
            raise UserError(f"--target {text!r}: no source {metric.split('/', 1)[1]!r} in "
                            f"the swarm (sources: {', '.join(sources)})")
        terms.append((weight, metric))
    return Target(text, tuple(terms))


def trial_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The held-out losses of a run summary as metric names: val_loss, val_loss/SOURCE."""
    out: dict[str, float] = {}
    for name, v in (summary.get("val_losses") or {}).items():
        if v is not None:
            out["val_loss" if name == "all" else f"val_loss/{name}"] = float(v)
    return out
