"""A training process: forked by its agent (trainlab.train.supervision.agent) from a warm
fork server, it owns the model, optimizer, process group and checkpoints, and
gets its data and runs rank 0's callbacks through the agent
(trainlab.train.supervision.protocol).

Exit codes: 0 after the run completed (the agent got `Done`), 1 after a failure
(the agent got `Failed(step, message)` when it could still be reached). Either
way the process ends with os._exit: nothing of the forked interpreter's exit
machinery (atexit, thread joins) runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from typing import Any

from trainlab.raycluster import normal_priority
from trainlab.train.checkpoint import StorageFault
from trainlab.train.supervision.logs import flush_logs, setup_logging
from trainlab.train.supervision.protocol import (
    ChildArgs,
    Done,
    Failed,
    PipeCallbacks,
    PipeClient,
    PipeLoader,
)

log = logging.getLogger("trainlab.train")


def failure_message(error: BaseException) -> str:
    """What the agent records of an error: its type and first line, at most 500 chars."""
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}"[:500]


def _to_log_file(text: str) -> None:
    """A line for logs/rank{r}.log only (not the terminal)."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, text, None, None)
    for handler in logging.getLogger("trainlab").handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def make_env(job: Any, args: ChildArgs, device: Any) -> Any:
    """This process's DistEnv: with tensor or pipeline parallelism, on the run's
    device mesh, after checking that no tensor-parallel group spans hosts."""
    import socket

    import torch.distributed as dist

    from trainlab.train.parallel.distributed import DistEnv
    from trainlab.train.parallel.mesh import MeshLayout, build_mesh, check_tp_groups

    layout = MeshLayout.of(job.cfg)
    mesh = None
    if args.world_size > 1 and layout.world_size == args.world_size and layout.model_parallel:
        hosts: list[Any] = [None] * args.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        check_tp_groups(layout, hosts)
        mesh = build_mesh(layout, device.type)
    return DistEnv(args.rank, args.world_size, args.local_rank, device, layout, mesh)


def main(args: ChildArgs, conn: Any) -> None:
    """Entry point of a training process (the agent's `Process` target)."""
    import torch
    import torch.distributed as dist

    from trainlab.train.loop.trainer import Trainer

    t0 = time.time()
    normal_priority()
    job = args.job
    setup_logging(job.logs_dir, args.rank)
    client = PipeClient(conn)
    trainer = None
    try:
        torch.set_num_threads(job.torch_threads)
        device = torch.device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if args.world_size > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend,
                init_method=f"tcp://{args.master_addr}:{args.master_port}",
                rank=args.rank,
                world_size=args.world_size,
            )
        log.info(
            "training process %d up: process group ready %.2f s after fork",
            os.getpid(),
            time.time() - t0,
        )
        env = make_env(job, args, device)
        callbacks = PipeCallbacks(client) if args.rank == 0 else None
        trainer = Trainer(job, PipeLoader(client), env, callbacks)
        trainer.fit()
        if dist.is_initialized():
            dist.destroy_process_group()
        client.call(Done())
    except BaseException as e:  # noqa: BLE001 - reported to the agent, then a non-zero exit
        step = trainer.step if trainer is not None else None
        if isinstance(e, StorageFault):  # said in one line; the traceback in the log file
            _to_log_file(f"training process failed at step {step}:\n{traceback.format_exc()}")
        else:
            # The error on the first line: the terminal shows that line (the traceback
            # goes to the rank's log); it ended in a bare colon.
            log.error(
                "training process failed at step %s: %s\n%s",
                step,
                failure_message(e),
                traceback.format_exc(),
            )
        with contextlib.suppress(Exception):  # the agent may be gone too
            client.call(Failed(step, failure_message(e)))
        flush_logs()
        os._exit(1)
    os._exit(0)
