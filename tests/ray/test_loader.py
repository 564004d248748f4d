"""The Ray Data side of the loader on the session's shared cluster: it delivers
exactly the in-process stream, per rank, from any step, including from actors
that hold the CPUs, as Ray Train workers do (where a starved pipeline would
deadlock)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from devtools.datasets import small_dataset
from trainlab.config import ExperimentConfig
from trainlab.data import DataSpec, WorkerLoader, prepare_run_data

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> DataSpec:
    root = small_dataset(tmp_path_factory.getbasetemp() / "small-ds")
    cfg = ExperimentConfig.model_validate(
        {
            "name": "t",
            "model": {"vocab_size": 1024},
            "data": {
                "path": str(root),
                "seq_len": 32,
                "micro_batch_size": 2,
                "grad_accum_steps": 2,
                "mix": {"code": 0.6, "docs": 0.3, "tiny": 0.1},
                "val_fraction": 0.1,
                "loader_cpus": 0.5,
            },
            "train": {"total_steps": 200, "warmup_steps": 1},
            "resource": {"num_workers": 2},
        }
    )
    return prepare_run_data(cfg)


def _digests(items: Any) -> list[tuple[int, str]]:
    """(step, hash of every array of every micro batch) per delivered step."""
    out = []
    for step, micro in items:
        h = hashlib.sha256()
        for m in micro:
            for k in sorted(m):
                h.update(k.encode() + m[k].dtype.str.encode() + np.ascontiguousarray(m[k]).data)
        out.append((step, h.hexdigest()))
    return out


def test_ray_data_delivers_exactly_the_in_process_stream(ray_cluster: Any, spec: DataSpec) -> None:
    for rank in range(2):
        ray_loader = WorkerLoader(spec, rank, 2)
        assert ray_loader.backend == "ray_data"
        got = _digests(ray_loader.iter_from(17, 150))  # a resume step, several blocks
        assert got == _digests(WorkerLoader(spec, rank, 2, backend="local").iter_from(17, 150))
        assert ray_loader.step == 150 and ray_loader.delivery.steps == 133


def test_abandoning_the_stream_midway_and_resuming_is_exact(
    ray_cluster: Any, spec: DataSpec
) -> None:
    first = WorkerLoader(spec, 0, 2)
    head = []
    for item in first.iter_from(0, 200):
        head.append(item)
        if item[0] == 40:
            break  # the consumer goes away with the pipeline running ahead
    resumed = WorkerLoader(spec, 0, 2)
    resumed.load_state_dict(first.state_dict())
    tail = list(resumed.iter_from(end=60))
    expected = _digests(WorkerLoader(spec, 0, 2, backend="local").iter_from(0, 60))
    assert _digests(head) + _digests(tail) == expected


def test_ranks_in_placement_group_actors_read_their_exact_rows(
    ray_cluster: Any, spec: DataSpec
) -> None:
    """Ray Train workers are actors holding a CPU bundle of a placement group; each
    rank's pipeline must run beside them (not starve, not wait for the bundle) and
    deliver exactly that rank's rows. The full Ray Train path runs in tests/ray/test_train.py."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=1)
    class Rank:
        def digests(self, spec: DataSpec, rank: int, world: int) -> tuple[str, list]:
            loader = WorkerLoader(spec, rank, world)
            return loader.backend, _digests(loader.iter_from(0, 40))

    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    ray.get(pg.ready(), timeout=60)
    try:
        ranks = [
            Rank.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=r
                )
            ).remote()
            for r in range(2)
        ]
        results = ray.get([a.digests.remote(spec, r, 2) for r, a in enumerate(ranks)], timeout=300)
    finally:
        remove_placement_group(pg)
    for rank, (backend, digests) in enumerate(results):
        assert backend == "ray_data"
        expected = _digests(WorkerLoader(spec, rank, 2, backend="local").iter_from(0, 40))
        assert [tuple(x) for x in digests] == expected
