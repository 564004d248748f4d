"""Process setup shared by a Ray Train worker (the agent) and its training
processes: trainlab's log handlers and the process priority; and, in the
driver, which of the worker output Ray forwards reaches the terminal."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

# In the driver, worker output: trainlab's lines on the terminal, the rest in a file.
from trainlab.raycluster import CONSOLE_PREFIX, route_worker_output  # noqa: F401

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


def flush_logs() -> None:
    """Flush trainlab's handlers (before a hard exit of the process)."""
    for handler in logging.getLogger("trainlab").handlers:
        handler.flush()


def normal_priority() -> None:
    """Ray runs its worker processes at nice 15 so its control plane stays responsive;
    training (the agent and its training process) is the node's main work, so it takes
    back the normal priority when allowed. At nice 15 every nice-0 process on the node
    (Ray's log monitor, GCS, a user's shell) preempts it almost entirely."""
    with contextlib.suppress(OSError):  # lowering niceness needs CAP_SYS_NICE
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
