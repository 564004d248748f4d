"""ParallelDims (trainlab.config.dims): the run's parallel dimensions by name,
and the decisions made once there (the dp default, which layouts execute)."""

from __future__ import annotations

import re

from tests.conftest import REPO
from trainlab.config import ExperimentConfig
from trainlab.config.dims import ParallelDims, default_dp, layout_executes


def cfg(parallel: dict, workers: int) -> ExperimentConfig:
    return ExperimentConfig.model_validate(
        {"name": "dims", "parallel": parallel, "resource": {"num_workers": workers}}
    )


def test_dims_are_asked_by_name():
    dims = ParallelDims(tp=2, pp=2, dp=2, zero_stage=3)
    at = dims.coords(5)  # pp-major, tp-minor: (1 * 2 + 0) * 2 + 1
    assert (at.pp, at.dp, at.tp) == (1, 0, 1) and dims.rank_of(**at._asdict()) == 5
    assert dims.degrees == {"pp": 2, "dp": 2, "tp": 2} and dims.world_size == 8
    assert dims.dp_shard == 2 and dims.dp_replicate == 1 and dims.model_parallel
    assert ParallelDims(dp=4, zero_stage=1).dp_replicate == 4


def test_the_dp_default_follows_from_the_workers_left_per_group():
    c = cfg({"strategy": "fsdp", "tp": 2}, 8)
    assert c.parallel.dp == 4 == ParallelDims.of(c).dp == default_dp(8, 2, 1)
    # The global batch counts the data-parallel ranks, not the workers.
    c = cfg({"strategy": "ddp", "tp": 2}, 4)
    assert c.global_batch_size == int(c.data.micro_batch_size) * 2


def test_which_layouts_execute_is_one_rule_for_config_and_planner():
    from trainlab.plan.planner import Layout

    assert layout_executes(2, 1, 2, 1) is not None  # ZeRO-1 beside tp over 2 replicas
    assert layout_executes(2, 1, 1, 1) is None and layout_executes(1, 1, 8, 1) is None
    assert not Layout(2, 1, 2, 1).executes and Layout(2, 1, 2, 0).executes
    try:
        cfg({"strategy": "ddp", "tp": 2, "zero_stage": 1}, 4)
    except ValueError as e:
        assert "ZeRO-1 (DDP with a sharded optimizer) does not compose" in str(e)
    else:
        raise AssertionError("ZeRO-1 with tp=2 over 2 replicas validated")


def test_the_dp_default_is_written_once():
    """A guard: nothing outside trainlab/config/dims.py divides the workers by the
    model-parallel group or falls back to the worker count for dp."""
    pattern = re.compile(r"num_workers\s*//|\.dp\s+or\s+|dp\s+or\s+\w*num_workers")
    offenders = []
    for path in (REPO / "platform" / "trainlab").rglob("*.py"):
        if path.name == "dims.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert offenders == []
