"""Learning-rate schedule: warmup, cosine decay, floor, resumability."""

from __future__ import annotations

import math

import pytest

from trainlab.config.schema import TrainConfig
from trainlab.train.loop.schedule import lr_at


def cfg(**kw) -> TrainConfig:
    return TrainConfig.model_validate(
        {"lr": 1e-3, "warmup_steps": 10, "total_steps": 110, "min_lr_ratio": 0.1, **kw}
    )


def test_warmup_is_linear_and_reaches_peak():
    t = cfg()
    assert lr_at(0, t) == pytest.approx(1e-4)
    assert lr_at(4, t) == pytest.approx(5e-4)
    assert lr_at(9, t) == pytest.approx(1e-3)
    assert lr_at(10, t) == pytest.approx(1e-3)


def test_cosine_decays_monotonically_to_the_floor_at_the_last_step():
    t = cfg()
    rates = [lr_at(s, t) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    assert rates[-1] == pytest.approx(1e-4)
    midpoint = 10 + (110 - 1 - 10) / 2
    assert lr_at(int(midpoint), t) == pytest.approx(5.5e-4, rel=0.02)
    assert lr_at(500, t) == pytest.approx(1e-4)


def test_no_warmup_starts_at_peak():
    t = cfg(warmup_steps=0, total_steps=3, min_lr_ratio=0.0)
    assert [lr_at(s, t) for s in range(3)] == pytest.approx([1e-3, 5e-4, 0.0])


def test_schedule_is_a_pure_function_of_the_step():
    """Resume needs nothing but the step: same inputs, same rate, no hidden state."""
    t = cfg()
    first = [lr_at(s, t) for s in range(110)]
    again = [lr_at(s, t) for s in reversed(range(110))][::-1]
    assert first == again
    assert all(math.isfinite(x) and x > 0 for x in first)
