"""trainlab.train.placement.lost_nodes on a real Ray cluster: the node of a
training worker whose process died is blamed, one that Ray stopped is not
(Ray's own actor table; the multi-node case is tests/e2e/test_cluster_submit.py)."""

from __future__ import annotations

import os
import signal

import pytest

from trainlab.train.placement import lost_nodes

pytestmark = pytest.mark.ray


def test_a_worker_that_died_blames_its_node_a_stopped_one_does_not(ray_cluster):
    import ray

    @ray.remote(num_cpus=0)
    class RayTrainWorker:  # the class name Ray Train's workers have
        def pid(self) -> int:
            return os.getpid()

    stopped = RayTrainWorker.remote()
    ray.get(stopped.pid.remote())
    ray.kill(stopped)  # what Ray Train does to the healthy workers of a failed group
    assert lost_nodes(timeout_s=30) == []

    died = RayTrainWorker.remote()
    os.kill(ray.get(died.pid.remote()), signal.SIGKILL)  # the process dies
    assert lost_nodes(timeout_s=30) == [ray.get_runtime_context().get_node_id()]
