"""Logging shared by a Ray Train worker (the agent) and its training processes:
trainlab's log handlers. The process priority (`normal_priority`) and the
driver's routing of worker output (`route_worker_output`) are trainlab.raycluster's."""

from __future__ import annotations

import logging
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
