"""The function every Ray Train worker runs: logging, threads, device, the data
stream and the callbacks for this rank, then the `Trainer`."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from trainlab.train.job import TrainJob

LOG_FORMAT = "%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"


def setup_logging(logs_dir: Path, rank: int) -> None:
    """logs/rank{r}.log gets every trainlab line with a timestamp and the rank;
    rank 0's also go to stderr (forwarded to the driver by Ray). trainlab's logger
    does not propagate, so Ray's own handlers do not print every rank's lines."""
    logs_dir.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("trainlab")
    for h in list(logger.handlers):
        logger.removeHandler(h)
    file_handler = logging.FileHandler(logs_dir / f"rank{rank}.log")
    file_handler.setFormatter(logging.Formatter(LOG_FORMAT.format(rank=rank)))
    logger.addHandler(file_handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("[trainlab] %(message)s"))
        logger.addHandler(console)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def make_callbacks(cfg: Any) -> Any:
    """MLflow + monitoring callbacks from trainlab.track when it provides them."""
    from trainlab.train.callbacks import CallbackList

    try:
        from trainlab.track import default_callbacks
    except ImportError:
        return CallbackList([])
    return CallbackList(default_callbacks(cfg))


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train's per-worker entry point (`TorchTrainer(train_loop_per_worker=...)`):
    this worker becomes the agent of its rank and supervises training processes
    (see trainlab.train.supervisor)."""
    import ray.train
    import torch

    from trainlab.train.supervisor import Agent, normal_priority, start_fork_server

    job = TrainJob.from_dict(config)
    os.environ.update(job.env)
    # The agent answers the training process's requests for data: same priority
    # (Ray starts workers at nice 15), and the fork server's children inherit it.
    normal_priority()
    start_fork_server(bool(job.cfg["train"]["deterministic"]))  # imports overlap what follows
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    setup_logging(job.logs_dir, rank)
    device = "cpu"
    if torch.cuda.is_available() and job.cfg["resource"]["use_gpu"]:
        import ray.train.torch

        device = str(ray.train.torch.get_device())
    from trainlab.data import WorkerLoader

    loader = WorkerLoader(job.data_spec, rank, world)
    callbacks = make_callbacks(_config(job)) if rank == 0 else None
    Agent(job, rank, world, ctx.get_local_rank(), device, loader, callbacks).run()


def _config(job: TrainJob) -> Any:
    from trainlab.config import ExperimentConfig

    return ExperimentConfig.model_validate(job.cfg)
