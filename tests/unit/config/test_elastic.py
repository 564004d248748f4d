"""Elastic runs (`resource.num_workers: {min, max}`, docs/elastic.md) without Ray:
the config and its refusals, the plan at both ends of the range, the resize
records, the sizes Ray may pick and the choice of the node chaos loses."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.conftest import RECIPES
from trainlab.config import ExperimentConfig, config_hash, load_config, to_yaml
from trainlab.errors import ConfigError, UserError
from trainlab.plan import plan, require_fit

TINY = str(RECIPES / "tiny.yaml")
ELASTIC = (
    "resource.num_workers.min=2",
    "resource.num_workers.max=3",
    "data.global_batch_size=12",
    "data.micro_batch_size=2",
)


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    return e.value.lines


def test_a_range_from_set_over_a_fixed_size_and_its_sizes():
    cfg = load_config(TINY, ELASTIC)
    r = cfg.resource
    assert r.elastic and (r.min_workers, r.max_workers, r.world_size) == (2, 3, 3)
    assert r.allowed_world_sizes() == [2, 3] and r.allowed_world_sizes(2) == [2]
    # One bound given over `num_workers: 2` (tiny's): the other is the fixed size.
    one = load_config(
        TINY, ("resource.num_workers.max=4", *ELASTIC[3:], "data.global_batch_size=24")
    )
    assert (one.resource.min_workers, one.resource.max_workers) == (2, 4)
    # dp and grad accumulation are left to the size; the YAML round-trips.
    assert cfg.parallel.dp is None and cfg.data.grad_accum_steps is None
    assert ExperimentConfig.model_validate(cfg.model_dump()) == cfg
    assert "min: 2" in to_yaml(cfg)
    fixed = load_config(TINY)
    assert not fixed.resource.elastic and fixed.resource.world_size == 2


def test_pinned_to_a_size_dp_and_grad_accum_follow_and_the_experiment_stays():
    cfg = load_config(TINY, ELASTIC)
    two, three = cfg.at_world_size(2), cfg.at_world_size(3)
    assert (two.parallel.dp, two.data.grad_accum_steps) == (2, 3)
    assert (three.parallel.dp, three.data.grad_accum_steps) == (3, 2)
    assert two.global_batch_size == three.global_batch_size == 12
    assert config_hash(two) == config_hash(three) == config_hash(cfg)
    fixed = load_config(TINY)
    assert fixed.at_world_size(2) is fixed


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (ELASTIC[:2], "data.global_batch_size = None: required for an elastic run"),
        ((*ELASTIC, "data.grad_accum_steps=1"), "data.grad_accum_steps = 1: leave it out for an elastic run"),
        ((*ELASTIC, "parallel.dp=3"), "parallel.dp = 3: leave it out for an elastic run"),
        (
            (*ELASTIC, "resource.num_workers.max=4"),
            "data.global_batch_size = 12: must be a multiple of data.micro_batch_size (2) x dp "
            "at every allowed size of an elastic run (resource.num_workers {min: 2, max: 4}): "
            "at 4 workers dp = 4",
        ),
        (
            (*ELASTIC, "resource.num_workers.min=3", "parallel.tp=2"),
            "resource.num_workers = {'min': 3, 'max': 3}: no multiple of tp x pp (2)",
        ),
        (
            (*ELASTIC, "resource.num_workers.min=4"),
            "resource.num_workers = {'min': 4, 'max': 3}: min (4) must be <= max (3)",
        ),
        (
            (*ELASTIC, "train.chaos.kill_rank=2"),
            "train.chaos.kill_rank = 2: must be < resource.num_workers.min (2)",
        ),  # fmt: skip
        ((*ELASTIC, "train.chaos.kill_node_at_steps=[60]"), "must be < train.total_steps (60)"),
    ],
)
def test_refusals_name_the_field_in_one_line(overrides, expected):
    lines = problems(*overrides)
    assert any(expected in line for line in lines), lines
    assert all("\n" not in line for line in lines)


def test_a_tp_range_allows_only_whole_tensor_groups():
    cfg = load_config(
        TINY,
        (*ELASTIC, "resource.num_workers.max=4", "parallel.tp=2", "data.global_batch_size=8"),
    )
    assert cfg.resource.allowed_world_sizes(2) == [2, 4]
    assert cfg.at_world_size(2).parallel.dp == 1 and cfg.at_world_size(4).parallel.dp == 2


def test_plan_shows_both_ends_and_refuses_a_minimum_that_does_not_fit():
    p = plan(load_config(TINY, ELASTIC))
    out = p.to_json()
    assert out["world_size"] == 3 and p.fits
    low, high = out["elastic"]["min"], out["elastic"]["max"]
    assert (low["world_size"], low["parallel"]["dp"], low["grad_accum_steps"]) == (2, 2, 3)
    assert (high["world_size"], high["parallel"]["dp"], high["grad_accum_steps"]) == (3, 3, 2)
    assert low["memory_per_device_bytes"]["total"] > 0 and low["fits"]

    def fsdp(memory_gb: float, workers: dict | int) -> ExperimentConfig:
        return ExperimentConfig.model_validate(
            {
                "name": "e",
                "model": {
                    "hidden_size": 1024,
                    "num_layers": 8,
                    "num_heads": 8,
                    "vocab_size": 32000,
                },
                "data": {"seq_len": 256, "micro_batch_size": 1, "global_batch_size": 12},
                "parallel": {"strategy": "fsdp", "zero_stage": 3},
                "resource": {"num_workers": workers, "cpu_memory_gb": memory_gb},
            }
        )

    # FSDP shards over dp: 4 workers fit in 2 GiB each, 2 do not.
    assert plan(fsdp(2.0, 4)).fits and not plan(fsdp(2.0, 2)).fits
    ranged = plan(fsdp(2.0, {"min": 2, "max": 4}))
    assert not ranged.fits and ranged.elastic["max"]["fits"] and not ranged.elastic["min"]["fits"]
    with pytest.raises(UserError, match=r"does not fit at the elastic minimum \(resource"):
        require_fit(ranged)


def _attempt(records, session: str, start: int, world: int, at: float) -> None:
    records.loc.append_jsonl(
        "logs/attempts.jsonl",
        [{"session": session, "start_step": start, "world_size": world, "time": at,
          "layout": {"tp": 1, "pp": 1, "dp": world}}],
    )  # fmt: skip


def test_resize_records(tmp_path: Path):
    from trainlab.run.records import Failure, RunRecords

    (tmp_path / "logs").mkdir()
    records = RunRecords(tmp_path)
    t = time.time() - 100
    _attempt(records, "s1", 0, 3, t)
    assert records.resize_of_latest_attempt(t + 1) is None  # the first start
    # The node is lost after step 7 was logged; the group restarts at 2 from step 6.
    records.loc.write_text("logs/progress.json", json.dumps({"step": 7, "time": t + 10}))
    records.add_failures(Failure("s1", "e1", 2, 7, "lost", "lost", time=t + 11))
    _attempt(records, "s1", 6, 2, t + 20)
    shrink = records.resize_of_latest_attempt(t + 25)
    assert shrink == {
        "step": 6, "from_world_size": 3, "to_world_size": 2, "from_dp": 3, "to_dp": 2,
        "reason": "node lost", "steps_redone": 1, "seconds": 14.0,
    }  # fmt: skip
    records.add_resize("s1", shrink)
    # Capacity returns: Ray restarts the group at 3 (no failure), from step 12.
    records.loc.write_text("logs/progress.json", json.dumps({"step": 12, "time": t + 40}))
    _attempt(records, "s1", 12, 3, t + 45)
    grow = records.resize_of_latest_attempt(t + 50)
    assert (grow["reason"], grow["steps_redone"], grow["seconds"]) == ("capacity returned", 0, 10)
    records.add_resize("s1", grow)
    assert [r["to_world_size"] for r in records.resizes()] == [2, 3]
    # An in-place restart at the same size, or a later start (another session) at
    # another size, is not a resize.
    _attempt(records, "s1", 14, 3, t + 60)
    assert records.resize_of_latest_attempt(t + 61) is None
    _attempt(records, "s2", 14, 1, t + 70)
    assert records.resize_of_latest_attempt(t + 71) is None
    # restarts: the attempts beyond each start's first (s1: 3); s2 is a later start
    assert records.restarts() == 3 and len(records.attempts()) == 5


def test_sizes_ray_may_pick_keep_tensor_groups_whole():
    from trainlab.train.driver.elastic import whole_groups

    assert whole_groups(3, 1, 2, 3) == 3
    assert whole_groups(5, 2, 2, 4) == 4  # capped at max, whole pairs
    assert whole_groups(3, 2, 2, 4) == 2  # a third worker cannot make a tp group
    assert whole_groups(1, 2, 2, 4) == 0  # below min: Ray waits (or the attempt fails)


def test_node_chaos_picks_a_worker_off_the_driver_node():
    from trainlab.train.loop.node_chaos import raylet_ancestor, victim_rank

    assert victim_rank(["head", "head", "w1", "w2"], "head") == 2
    assert victim_rank(["head", None], "head") is None
    assert victim_rank(["head"], "head") is None
    assert raylet_ancestor(os.getpid()) is None  # not under a raylet here


def test_a_restart_that_failed_before_a_step_is_not_where_a_resize_is_measured_from(
    tmp_path: Path,
):
    """A node lost after step 5: Ray first restarted the group at 3 on a view that
    still counted the node (that attempt never stepped), then at 2. The shrink is
    from the 3 workers that trained, redoes step 5, and its time runs from the
    loss (the e2e test once read steps_redone 0 from the failed restart)."""
    from trainlab.run.records import Failure, RunRecords

    (tmp_path / "logs").mkdir()
    records = RunRecords(tmp_path)
    t = time.time() - 100
    _attempt(records, "s1", 0, 3, t)
    records.first_step_done("s1", 1)  # stamped now: inside the first attempt's window
    now = time.time()
    records.loc.write_text("logs/progress.json", json.dumps({"step": 5, "time": now + 1}))
    records.add_failures(Failure("s1", "e1", 2, 5, "lost", "lost", time=now + 2))
    _attempt(records, "s1", 4, 3, now + 10)  # failed before its first step
    records.add_failures(Failure("s1", "e2", 0, None, "lost", "lost", time=now + 20))
    _attempt(records, "s1", 4, 2, now + 30)
    shrink = records.resize_of_latest_attempt(now + 32)
    assert (shrink["from_world_size"], shrink["to_world_size"]) == (3, 2)
    assert (shrink["step"], shrink["steps_redone"], shrink["seconds"]) == (4, 1, 30.0)
