"""Process setup shared by a Ray Train worker (the agent) and its training
processes: trainlab's log handlers and the process priority; and, in the
driver, which of the worker output Ray forwards reaches the terminal."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from pathlib import Path

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


# The prefix of trainlab's own lines on a worker's stderr (setup_logging): the only
# worker output the driver's terminal shows.
CONSOLE_PREFIX = "[trainlab] "


def route_worker_output(log_file: Path) -> bool:
    """In the driver: worker output Ray forwards (its log monitor) is shown on the
    terminal only for trainlab's own lines; the rest (Ray Train's controller and
    placement-group cleaner, `core_worker.cc` error lines, MLflow's INFO lines,
    tracebacks Ray's internals print under load) is appended to `log_file`.
    Replaces the handler `ray.init(log_to_driver=True)` installed (a private API
    of Ray 2.60, `ray._private.ray_logging`); returns False, changing nothing,
    where it is not there."""
    try:
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    if not any(name == "ray_print_logs" for name, _ in dispatcher.handlers):
        return False
    ignore_prefix = ray_worker._should_ignore_worker_log_prefix(ray_worker.global_worker)
    lock = threading.Lock()

    def handle(data: dict) -> None:
        if data.get("pid") in ("autoscaler", "raylet"):  # Ray filters these itself
            ray_worker.print_to_stdstream(data, ignore_prefix=ignore_prefix)
            return
        lines = data.get("lines") or []
        ours = [line for line in lines if line.startswith(CONSOLE_PREFIX)]
        rest = [line for line in lines if not line.startswith(CONSOLE_PREFIX)]
        if ours:
            ray_worker.print_to_stdstream({**data, "lines": ours}, ignore_prefix=ignore_prefix)
        if rest:
            who = data.get("actor_name") or data.get("task_name") or ""
            head = f"({who} pid={data.get('pid')}) "
            with lock, open(log_file, "a") as f:
                f.writelines(head + line + "\n" for line in rest)

    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", handle)
    return True
