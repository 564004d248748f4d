"""Learning-rate schedule: linear warmup, then cosine decay to min_lr_ratio * lr.

A pure function of the step, so the schedule's whole state is the step number
(nothing to checkpoint beyond it) and a resumed run gets exactly the same rates.
"""

from __future__ import annotations

import math

from trainlab.config.schema import TrainConfig


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based: the step about to be taken).

    Warmup: lr * (step + 1) / warmup_steps for the first warmup_steps steps, so the
    first step already moves. Then cosine from lr down to min_lr_ratio * lr,
    reached at the last step (total_steps - 1) and held after it.
    """
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    decay_steps = max(1, t.total_steps - 1 - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / decay_steps)
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
