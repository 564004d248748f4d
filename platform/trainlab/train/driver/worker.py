"""The function every Ray Train worker runs: environment, priority, logging,
device, the data stream and (on rank 0) the callbacks, then the `Agent` that
runs this rank's training processes (trainlab.train.supervision.agent)."""

from __future__ import annotations

import os
import uuid
from typing import Any

from trainlab.raycluster import normal_priority
from trainlab.run.location import LogShipper
from trainlab.train.job import NODE_ID_ENV, TrainJob
from trainlab.train.loop.callbacks import build_callbacks
from trainlab.train.supervision.agent import Agent, free_port, start_fork_server
from trainlab.train.supervision.logs import setup_logging


class RayRendezvous:
    """The agents' collectives over Ray Train (`ray.train.collective`): rank 0 picks
    the training processes' address and a free port and broadcasts them."""

    def __init__(self, rank: int):
        self.rank = rank

    def rendezvous(self, attempt: int, group: str | None) -> tuple[str, int, str]:
        from ray.train.collective import broadcast_from_rank_zero

        offer = None
        if self.rank == 0:
            import ray.util

            offer = (ray.util.get_node_ip_address(), free_port(), group or uuid.uuid4().hex[:8])
        return broadcast_from_rank_zero(offer)

    def barrier(self) -> None:
        from ray.train.collective import barrier

        barrier()


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train's per-worker entry point (`TorchTrainer(train_loop_per_worker=...,
    train_loop_config={"job": job})`): this worker becomes the agent of its rank."""
    import ray
    import ray.train
    import torch

    job: TrainJob = config["job"]
    os.environ.update(job.env)
    # Which node this is (the fork server's children inherit it): train.chaos's
    # kill_node_at_steps loses a node other than the driver's.
    os.environ[NODE_ID_ENV] = ray.get_runtime_context().get_node_id()
    # The agent answers the training process's requests for data: same priority
    # (Ray starts workers at nice 15), and the fork server's children inherit it.
    normal_priority()
    mp_context = start_fork_server(job.cfg.train.deterministic)  # imports overlap what follows
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    # An elastic run trains at the size Ray placed this time: dp and grad accumulation
    # follow it, the global batch and the data of each step do not.
    job = job.at_world_size(world)
    setup_logging(job.logs_dir, rank)
    device = "cpu"
    if torch.cuda.is_available() and job.cfg.resource.use_gpu:
        import ray.train.torch

        device = str(ray.train.torch.get_device())
    from trainlab.data import WorkerLoader
    from trainlab.train.parallel.mesh import MeshLayout

    # The ranks of one tensor/pipeline group read the same rows: the stream is
    # split by data-parallel rank.
    layout = MeshLayout.of(job.cfg)
    dp_rank, dp = (
        (layout.coords(rank).dp, layout.dp) if layout.world_size == world else (rank, world)
    )
    loader = WorkerLoader(job.data_spec, dp_rank, dp)
    callbacks = None
    if rank == 0:  # the alert sinks read the hooks' variables from the environment
        from trainlab.hooksecrets import apply_in_worker

        apply_in_worker(config.get("hook_secrets"))
        callbacks = build_callbacks(job.callbacks, job.cfg)
    agent = Agent(
        job,
        rank,
        world,
        ctx.get_local_rank(),
        device,
        loader,
        callbacks,
        rendezvous=RayRendezvous(rank),
        mp_context=mp_context,
    )
    # A run in object storage: this rank's log (rank 0: its node's logs, the
    # MLflow journal and the alert log with them) goes to the store as it grows.
    with LogShipper(job.location, None if rank == 0 else [f"rank{rank}.log"]):
        agent.run()
