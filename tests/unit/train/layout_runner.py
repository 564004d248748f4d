"""Runs the real Trainer on N local processes (gloo, no Ray) for a layout, and
returns rank 0's per-step losses and run summary: the harness of the layout
numerics tests (tests/unit/train/test_layouts.py)."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainlab.train.loop.callbacks import Callback


class Losses(Callback):
    """Records every logged step's loss; asks the run to stop at `stop_at`."""

    def __init__(self, path: str, stop_at: int | None):
        self.path, self.stop_at = path, stop_at
        self.losses: dict[int, float] = {}
        self.grad_norms: dict[int, float] = {}

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        self.losses[step] = float(metrics["loss"])
        self.grad_norms[step] = float(metrics["grad_norm"])
        Path(self.path).write_text(json.dumps(self.losses))
        Path(self.path.replace(".losses.", ".grad_norms.")).write_text(json.dumps(self.grad_norms))
        if step == self.stop_at:
            self.stop_requested, self.stop_reason = True, f"the test stops at step {step}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, job: Any, out: str, stop_at: int | None) -> None:
    from trainlab.data import WorkerLoader
    from trainlab.train.loop.trainer import Trainer
    from trainlab.train.supervision.child import make_env
    from trainlab.train.supervision.protocol import ChildArgs

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    args = ChildArgs(job, rank, world, 0, "cpu", "127.0.0.1", port)
    env = make_env(job, args, torch.device("cpu"))
    loader = WorkerLoader(job.data_spec, env.dp_rank, env.dp_size, backend="local")
    callbacks = Losses(out + ".losses.json", stop_at) if rank == 0 else None
    try:
        summary = Trainer(job, loader, env, callbacks).fit()
    except BaseException:
        import traceback

        traceback.print_exc()
        raise
    if rank == 0:
        Path(out).write_text(json.dumps(summary))
    if world > 1:
        dist.destroy_process_group()
        # A spawned process ends as trainlab's training processes do (train/child.py):
        # without the interpreter's exit, where gloo threads still alive in objects it
        # tears down can call std::terminate (seen once in CI: SIGABRT after a
        # completed tensor-parallel run, "terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def grad_norms(out: Path) -> dict[int, float]:
    """The global gradient norm of every step of a `run_layout(..., out)` (rank 0's)."""
    norms = json.loads(Path(str(out) + ".grad_norms.json").read_text())
    return {int(k): v for k, v in norms.items()}


def run_layout(
    job: Any, world: int, out: Path, stop_at: int | None = None
) -> tuple[dict[int, float], dict[str, Any]]:
    """Train `job` on `world` processes (stopping after step `stop_at`, with a
    checkpoint); (losses by step, run summary) of rank 0."""
    args = (world, _free_port(), job, str(out), stop_at)
    if world == 1:
        _worker(0, *args)
    else:
        mp.spawn(_worker, args=args, nprocs=world, join=True)
    losses = json.loads(Path(str(out) + ".losses.json").read_text())
    return {int(k): v for k, v in losses.items()}, json.loads(out.read_text())
