"""No host sync inside a training step that neither logs, evaluates nor
checkpoints: the labelled-token count, the loss scale and the gradient norm stay
on the device (trainlab.train.loop.step), the values are read one step late
(trainlab.train.loop.metrics).

Counted as torch counts it: `aten._local_scalar_dense`, what `.item()`,
`float()`, `int()` and `bool()` of a tensor dispatch to, under a
`TorchDispatchMode` around the real Trainer's step and the launch of its
signals, at step 2 (the first step sets things up: pipeline shape inference,
optimizer state). On one process and on two gloo processes for DDP, FSDP,
tp=2 and pp=2 (one spawn runs the four layouts in turn: starting processes is
what costs)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from devtools.bench.sync_bench import host_reads_counter
from tests.train_helpers import dataset_dir, make_job, tiny_config
from tests.unit.train.layout_runner import _free_port

LAYOUTS = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp", "zero_stage": 3},
    "tp2": {"strategy": "ddp", "tp": 2},
    "pp2": {"strategy": "ddp", "pp": 2},
}


def config(dataset: Path, parallel: dict[str, Any], workers: int):
    return tiny_config(
        dataset,
        data={"global_batch_size": 8, "micro_batch_size": 2},
        train={"total_steps": 4, "log_interval": 100, "eval_interval": 100},
        parallel=parallel,
        resource={"num_workers": workers},
    )


def host_reads_of_step_2(job: Any, rank: int, world: int, port: int) -> int:
    """The reads of the real Trainer's second step (and its signals' launch)."""
    from trainlab.data import WorkerLoader
    from trainlab.train.loop.metrics import launch
    from trainlab.train.loop.trainer import Trainer
    from trainlab.train.supervision.child import make_env
    from trainlab.train.supervision.protocol import ChildArgs

    env = make_env(
        job, ChildArgs(job, rank, world, 0, "cpu", "127.0.0.1", port), torch.device("cpu")
    )
    loader = WorkerLoader(job.data_spec, env.dp_rank, env.dp_size, backend="local")
    trainer = Trainer(job, loader, env)
    trainer._start()
    stream = trainer.loader.iter_from(0)
    trainer.train_step(next(stream)[1])  # step 1
    batches = next(stream)[1]
    with host_reads_counter() as reads:
        loss, norm = trainer.train_step(batches)
        launch(env, trainer.step, loss, norm, 0.0, 0.0)
    return reads.count


def _worker(rank: int, world: int, port: int, jobs: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counts = {name: host_reads_of_step_2(job, rank, world, port) for name, job in jobs.items()}
    Path(f"{out}.{rank}.json").write_text(json.dumps(counts))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as layout_runner: gloo threads must not outlive the interpreter


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def test_no_host_read_in_a_quiet_step(dataset, tmp_path):
    one = make_job(config(dataset, {"strategy": "ddp"}, 1), tmp_path / "one")
    assert host_reads_of_step_2(one, 0, 1, 0) == 0
    jobs = {
        name: make_job(config(dataset, parallel, 2), tmp_path / name)
        for name, parallel in LAYOUTS.items()
    }
    out = str(tmp_path / "counts")
    mp.spawn(_worker, args=(2, _free_port(), jobs, out), nprocs=2, join=True)
    for rank in range(2):
        counts = json.loads(Path(f"{out}.{rank}.json").read_text())
        assert counts == dict.fromkeys(LAYOUTS, 0), (rank, counts)
