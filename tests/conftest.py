"""Shared fixtures. Unit tests (tests/unit) never start Ray; tests under
tests/ray and tests/e2e share ONE local Ray cluster per session (starting one
costs 5-9 s), through the `ray_cluster` fixture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "trainers" / "recipes"

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's local Ray cluster (8 logical CPUs on a 2-core machine; see
    ARCHITECTURE.md on why fewer deadlocks Ray Train + Ray Data)."""
    import ray

    from trainlab.raycluster import ensure_ray

    os.environ.pop("RAY_ADDRESS", None)
    resources = ensure_ray(num_cpus=8)
    yield resources
    ray.shutdown()


@pytest.fixture
def repo() -> Path:
    return REPO
