"""Tune's limits: samples only where there is something to draw, and trials at
once as the machine fits (no Ray started here)."""

from __future__ import annotations

import pytest

from trainlab.errors import UserError
from trainlab.tune import DEFAULT_SAMPLES, _seeded_search, check_samples, parse_search


def test_samples_of_a_pure_grid_are_refused_and_default_to_one():
    grid = parse_search(["data.mix.code=0.2,0.8", "data.mix.docs=1,2"])
    with pytest.raises(UserError, match="--samples 2: every --search is a grid"):
        check_samples(grid, 2)
    assert check_samples(grid, None) == 1 and check_samples(grid, 1) == 1


def test_samples_draw_the_random_dimensions():
    mixed = parse_search(["data.mix.code=0.2,0.8", "data.mix.docs=0.1:0.9"])
    assert check_samples(mixed, None) == DEFAULT_SAMPLES
    assert check_samples(mixed, 3) == 3


def test_the_concurrency_limit_is_on_the_search_algorithm_tune_keeps():
    """Tune drops max_concurrent_trials next to a BasicVariantGenerator; the
    generator's own limit is what it applies."""
    search = _seeded_search(seed=0, max_concurrent=1)
    assert search.max_concurrent == 1
