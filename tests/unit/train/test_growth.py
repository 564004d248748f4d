"""An elastic run grows at a checkpoint taken for it (trainlab.train.loop.growth,
trainlab.train.driver.elastic): the controller asks, rank 0 has every rank take
a checkpoint and hold there, the controller restarts the group larger from it,
or cancels and the ranks go on; nothing of the training changes."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time

import pytest

from tests.train_helpers import dataset_dir, local_loader, make_job, tiny_config
from trainlab.run.records import RESIZE_REQUEST, Growth, GrowthState, RunRecords

ASK = "tests.unit.train.loop_components:ask_growth_at_three"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def _fit(cfg, run_dir, elastic: bool):
    from trainlab.train.loop.trainer import Trainer
    from trainlab.train.parallel.distributed import DistEnv

    job = dataclasses.replace(make_job(cfg, run_dir), elastic=elastic)
    return Trainer(job, local_loader(job), DistEnv()).fit()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_ranks_hold_at_a_committed_checkpoint_then_go_on_unchanged(
    dataset, tmp_path, monkeypatch, async_save
):
    from trainlab.run import checkpoints as ckpts
    from trainlab.train.loop import growth

    monkeypatch.setattr(growth, "CHECK_EVERY_S", 0.0)
    cfg = tiny_config(
        dataset,
        train={
            "total_steps": 8,
            "eval_interval": 100,
            "components": [ASK],
            "checkpoint": {"every_steps": 100, "keep_last": 10, "async_save": async_save},
        },
    )
    run = tmp_path / "elastic"
    seen: dict = {}

    def controller() -> None:  # what LayoutScalingPolicy does with the request
        records = RunRecords(run)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            record = records.growth()
            if record and record.state is GrowthState.READY:
                seen["step"] = record.step
                seen["committed"] = [c.step for c in ckpts.catalog(records.loc).committed()]
                time.sleep(1.5)  # the ranks hold meanwhile: step 8 is not reached
                seen["later"] = [c.step for c in ckpts.catalog(records.loc).committed()]
                records.cancel_growth()  # no room after all: the ranks go on
                return
            time.sleep(0.05)

    thread = threading.Thread(target=controller)
    thread.start()
    held = _fit(cfg, run, elastic=True)
    thread.join()
    plain = _fit(cfg, tmp_path / "plain", elastic=False)  # the request is not heard
    # Asked at step 3's end, heard with step 4's signals (read at once: the tiny
    # recipe logs every step): held at step 4, its checkpoint committed first.
    assert seen["step"] == 4 and seen["committed"] == seen["later"] == [4]
    assert held["status"] == plain["status"] == "completed" and held["final_step"] == 8
    assert held["weights_sha256"] == plain["weights_sha256"]
    assert held["final_loss"] == plain["final_loss"]
    assert {c.step for c in ckpts.catalog(RunRecords(tmp_path / "plain").loc).committed()} == {8}
    assert {c.step for c in ckpts.catalog(RunRecords(run).loc).committed()} == {4, 8}
    assert RunRecords(run).growth() is None


@pytest.fixture(params=["local", "s3"])
def run_home(request, tmp_path, monkeypatch) -> str:
    """Where the run lives: a directory, or object storage (moto's S3 server on
    127.0.0.1, tests/conftest.py): the controller and rank 0 talk through it."""
    if request.param == "local":
        return str(tmp_path / "run")
    _, bucket = request.getfixturevalue("s3_env")
    monkeypatch.setenv("TRAINLAB_SCRATCH_DIR", str(tmp_path / "scratch"))
    return f"s3://{bucket}/runs/2026-12-05/elastic"


def test_the_policy_restarts_larger_only_once_the_ranks_hold(run_home):
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision

    from trainlab.train.driver import elastic

    policy = elastic.LayoutScalingPolicy(ScalingConfig(num_workers=(2, 3)), 1, run_home)
    records = RunRecords(run_home)
    grow = ResizeDecision(num_workers=3, resources_per_worker={"CPU": 1})
    request = records.request_growth(3)
    policy._growth = (grow, request, time.monotonic())
    assert isinstance(policy._growth_decision(), NoopDecision)  # not taken yet
    # Taken up by rank 0: its checkpoint may take long (a large model to a store);
    # the policy waits past GROWTH_WAIT_S instead of wasting it.
    records.growth_accepted(request)
    policy._growth = (grow, request, time.monotonic() - elastic.GROWTH_WAIT_S - 1)
    assert isinstance(policy._growth_decision(), NoopDecision)
    assert records.growth().state is GrowthState.ACCEPTED
    records.growth_ready(request, 12)
    assert policy._growth_decision() is grow
    assert records.growth() == Growth(request, 3, GrowthState.GO, 12)
    raw = json.loads(records.loc.read_text(f"logs/{RESIZE_REQUEST}"))  # as written
    assert raw == {"to_world_size": 3, "id": request, "state": "go", "step": 12}
    records.growth_accepted(request)  # late: a state never moves back
    assert records.growth().state is GrowthState.GO
    # Not taken up within GROWTH_WAIT_S: cancelled, the ranks go on.
    policy._growth = (grow, records.request_growth(3), time.monotonic() - elastic.GROWTH_WAIT_S - 1)
    assert isinstance(policy._growth_decision(), NoopDecision) and records.growth() is None
    # A request the run no longer has (a new worker group cleared it): no growth.
    policy._growth = (grow, records.request_growth(3), time.monotonic())
    records.cancel_growth()
    assert isinstance(policy._growth_decision(), NoopDecision) and policy._growth is None


def test_a_node_whose_raylet_does_not_answer_is_not_counted():
    from trainlab.train.driver.elastic import live_nodes

    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: refuses
        nodes = [
            {"NodeID": "a", "Alive": True, "NodeManagerAddress": "127.0.0.1",
             "NodeManagerPort": listening.getsockname()[1]},
            {"NodeID": "b", "Alive": True, "NodeManagerAddress": "127.0.0.1",
             "NodeManagerPort": closed.getsockname()[1]},
            {"NodeID": "c", "Alive": False, "NodeManagerAddress": "127.0.0.1",
             "NodeManagerPort": listening.getsockname()[1]},
        ]  # fmt: skip
        assert live_nodes(nodes) == ({"a"}, {"b"})


def _policy_on(reserved: dict, unit: int = 1, lo: int = 2, hi: int = 3):
    """The policy deciding on a fixed view of the cluster (the reserved resources
    Ray's autoscaling coordinator would return; no coordinator here)."""
    from ray.train import ScalingConfig

    from trainlab.train.driver.elastic import LayoutScalingPolicy

    policy = LayoutScalingPolicy(
        ScalingConfig(num_workers=(lo, hi), resources_per_worker={"CPU": 2}), unit
    )
    policy._maybe_send_resource_request = lambda: None
    policy._get_reserved_resources = lambda: reserved
    policy._probe = lambda: None  # every node answers
    return policy


def test_restarts_keep_tensor_groups_whole_and_below_min_fail_as_fixed_size_runs_do():
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision

    from trainlab.train.driver import elastic

    three = {f"n{i}": {"CPU": 2.0} for i in range(3)}
    assert _policy_on(three).make_decision_for_non_running_worker_group().num_workers == 3
    # tp x pp = 2: room for 3 workers (max 4) makes workers for one tp group of 2, not 3.
    tp = _policy_on(three, unit=2, lo=2, hi=4)
    assert tp.make_decision_for_non_running_worker_group().num_workers == 2
    # Room for one worker, min 2. At the first start: wait, as long as Ray does (an
    # autoscaler may be adding nodes).
    short = _policy_on({"n0": {"CPU": 2.0}})
    assert isinstance(short.make_decision_for_non_running_worker_group(), NoopDecision)
    assert short._short_since is None
    # After a group ran and was lost: wait resource.below_min_wait_s, then the
    # attempt fails (job retries apply), not wait for ever.
    short._ran = True
    assert isinstance(short.make_decision_for_non_running_worker_group(), NoopDecision)
    short._short_since -= elastic.BELOW_MIN_WAIT_S + 1
    with pytest.raises(elastic.TooFewWorkers, match=r"num_workers.min = 2 .* 60 s"):
        short.make_decision_for_non_running_worker_group()


@pytest.mark.parametrize(
    "text",
    ["", "not json", "[]", '{"id": "a", "state": "requested"}',
     '{"id": "a", "to_world_size": 3, "state": "grown"}'],
)  # fmt: skip
def test_a_growth_record_that_is_not_one_reads_as_no_request(text):
    assert Growth.parse(text) is None
