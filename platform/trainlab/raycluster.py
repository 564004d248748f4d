"""Connecting to Ray: the cluster at RAY_ADDRESS, or an embedded local one.

A command of the `trainlab` CLI run while the local cluster of `trainlab
cluster up` is running uses that cluster: the CLI sets RAY_ADDRESS (and what a
driver of that cluster needs) before Ray is imported, and names it in
`LOCAL_CLUSTER_ENV` (trainlab.cli.localray); `ensure_ray` then says so.

The embedded cluster advertises more logical CPUs than the machine has cores
(max(8, 2 x cores)): on a 2-core box a `num_cpus=2` cluster deadlocks as soon
as two 1-CPU training workers and a Ray Data pipeline share it (the data
operators never get a CPU). Work that runs beside training caps its own
resources instead of relying on the count (see trainlab.data and
docs/ray-resources.md).

Ray's own output in a command's driver (the worker output its log monitor
forwards, its Python log records: the token-auth notice, Ray Data's and Tune's
INFO lines) goes to a log file, not the terminal, once a command asks for it
(`route_ray_output`, applied by `ensure_ray`): the terminal keeps trainlab's
lines and Ray's errors.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Ray Train V2's placement-group cleaner asks the state API (served by the
# dashboard) every second whether the controller lives. The embedded cluster has
# no dashboard and dies with its driver, placement groups included, so the
# cleaner has nothing to do there and its "state API unavailable" warning is noise.
_EMBEDDED_NOISE = {
    "ray.train.v2._internal.execution.controller.placement_group_cleaner": "Failed to query Ray Train Controller actor state",
}


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_embedded_worker_logs() -> None:
    """worker_process_setup_hook of the embedded cluster (see _EMBEDDED_NOISE)."""
    for logger_name, prefix in _EMBEDDED_NOISE.items():
        logging.getLogger(logger_name).addFilter(_DropMessages(prefix))


# The address of the local cluster of `trainlab cluster up` when the CLI chose it
# for RAY_ADDRESS (trainlab.cli.localray): said when Ray connects to it.
LOCAL_CLUSTER_ENV = "TRAINLAB_LOCAL_CLUSTER"


def from_local_cluster(address: str | None) -> bool:
    """`address` is the local cluster of `trainlab cluster up`, chosen by the CLI."""
    return bool(address) and address == os.environ.get(LOCAL_CLUSTER_ENV)


def local_num_cpus(requested: int | None = None) -> int:
    return requested or max(8, 2 * (os.cpu_count() or 1))


# --------------------------------------------------------------------------- Ray's output

# Where this process sends Ray's output (route_ray_output); None: where Ray prints it.
_routed_to: Path | None = None
_said: set[Path] = set()  # log files whose line is printed at exit

# The prefix of trainlab's own lines on a worker's stderr (trainlab.train.supervision.logs): the
# only worker output the driver's terminal shows.
CONSOLE_PREFIX = "[trainlab] "
# How the raylet's warnings start (forwarded to the driver like worker output).
RAYLET_WARNING = "WARNING: "


def command_log(command: str) -> Path:
    """The log file a Ray-backed command's Ray output goes to:
    `$TRAINLAB_LOG_DIR` (default `{tempdir}/trainlab-logs`) /
    `{command}-{YYYYmmdd-HHMMSS}-{pid}.log`."""
    root = Path(os.environ.get("TRAINLAB_LOG_DIR") or Path(tempfile.gettempdir(), "trainlab-logs"))
    return root / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def route_ray_output(log_file: str | os.PathLike[str]) -> Path:
    """From Ray's start in this process (`ensure_ray`; at once if it runs), its
    output goes to `log_file`: forwarded worker output that is not trainlab's
    (`route_worker_output`) and Ray's Python log records below ERROR
    (`route_ray_records`); at exit, one line on stderr says where, if anything
    went there."""
    global _routed_to
    _routed_to = Path(log_file).resolve()
    # Ray Tune's newer console output `print`s its experiment banner and result
    # paths even at verbose=0 (ray/tune/experimental/output.py); its classic
    # reporter prints nothing there (a Tune search reports through trainlab).
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # MLflow's INFO lines ("Creating initial MLflow database tables", system-metrics
    # start and stop) in this driver and the embedded cluster's workers it starts.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    if "mlflow" in sys.modules:  # configured already: the variable came too late
        logging.getLogger("mlflow").setLevel(logging.WARNING)
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        _apply_route(_routed_to)
    return _routed_to


def _apply_route(log_file: Path) -> None:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    route_worker_output(log_file)
    route_ray_records(log_file)
    if log_file not in _said:
        _said.add(log_file)
        atexit.register(_say_where, log_file)


def _say_where(log_file: Path) -> None:
    """At exit, one line on stderr when Ray printed anything (it went to the file)."""
    try:
        lines = sum(1 for _ in log_file.open())
    except OSError:
        return
    if lines:
        print(f"({lines} lines of Ray's own output: {log_file})", file=sys.stderr, flush=True)


def route_ray_records(log_file: Path) -> bool:
    """Ray's Python log records in this driver (every Ray logger prints through
    `ray._private.log.PlainRayHandler`, which Ray Data, Train and Tune configure
    whenever they are imported) below ERROR are appended to `log_file` instead of
    the terminal; errors go to both. A private API of Ray 2.60: returns False,
    changing nothing, where it is not there."""
    try:
        from ray._private.log import PlainRayHandler
    except ImportError:
        return False
    original = getattr(PlainRayHandler, "_trainlab_original_emit", PlainRayHandler.emit)
    to_file = logging.FileHandler(log_file)
    to_file.setFormatter(
        logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s %(filename)s:%(lineno)s -- %(message)s"
        )
    )

    def emit(self: Any, record: logging.LogRecord) -> None:
        to_file.handle(record)
        if record.levelno >= logging.ERROR:
            original(self, record)

    PlainRayHandler._trainlab_original_emit = original  # type: ignore[attr-defined]
    PlainRayHandler.emit = emit  # type: ignore[method-assign]
    return True


# Ray's own lines in a text stream (a job's logs): C++ log lines (`[2026-12-04
# 16:00:00,123 E 4242 4242] core_worker.cc:...`), Ray's Python log format, MLflow's
# INFO lines, and worker output Ray forwarded (`(actor pid=42) ...`) that is not
# trainlab's own.
_RAY_LINE = re.compile(
    r"^(\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [DIWEFC] \d+ \d+\] "
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+:\d+ -- "
    r"|\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING) mlflow"
    r"|\([^()]*pid=\d+[^()]*\) (?!\[trainlab\] ))"
)


class LineRouter:
    """Splits a stream of text (chunks, not necessarily whole lines) into
    trainlab's lines, passed to `show`, and Ray's (`_RAY_LINE`), appended to
    `log_file`; an indented line (a traceback's) goes where the line before it
    went."""

    def __init__(self, show: Any, log_file: Path):
        self.show, self.log_file = show, log_file
        self._partial = ""
        self._last_was_ray = False
        self.shown = self.routed = 0

    def write(self, text: str) -> None:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        if lines:
            self._route([line + "\n" for line in lines])

    def close(self) -> None:
        if self._partial:
            self._route([self._partial + "\n"])
            self._partial = ""

    def _route(self, lines: list[str]) -> None:
        ours, ray = [], []
        for line in lines:
            indented = line[:1] in (" ", "\t") and line.strip()
            is_ray = self._last_was_ray if indented else bool(_RAY_LINE.match(line))
            (ray if is_ray else ours).append(line)
            self._last_was_ray = is_ray
        if ray:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_file, "a") as f:
                f.writelines(ray)
            self.routed += len(ray)
        if ours:
            self.show("".join(ours))
            self.shown += len(ours)


def route_worker_output(log_file: str | os.PathLike[str]) -> bool:
    """In the driver: worker output Ray forwards (its log monitor) is shown on the
    terminal only for trainlab's own lines; the rest (Ray Train's controller and
    placement-group cleaner, `core_worker.cc` error lines, MLflow's INFO lines,
    tracebacks Ray's internals print under load, the raylet's warnings) is
    appended to `log_file`; trainlab's lines are not deduplicated (Ray would merge
    the progress lines of concurrent Tune trials as repeats). Replaces the handler
    `ray.init(log_to_driver=True)` installed and wraps Ray's printer (private APIs
    of Ray 2.60, `ray._private.ray_logging`, `ray._private.worker`); returns
    False, changing nothing, where they are not there."""
    try:
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    if not any(name == "ray_print_logs" for name, _ in dispatcher.handlers):
        return False
    ignore_prefix = ray_worker._should_ignore_worker_log_prefix(ray_worker.global_worker)
    lock = threading.Lock()

    original = getattr(ray_worker, "_trainlab_print_to_stdstream", ray_worker.print_to_stdstream)

    def print_to_stdstream(data: dict, ignore_prefix: bool) -> None:
        """Ray's own printer (also of the raylet's messages to the driver), less the
        raylet's warnings (e.g. "N PYTHON worker processes have been started"): its
        other notices (a worker killed for memory, an actor that died) stay."""
        lines = data.get("lines") or []
        if data.get("pid") == "raylet":
            warnings = [line for line in lines if line.startswith(RAYLET_WARNING)]
            if warnings:
                with lock, open(log_file, "a") as f:
                    f.writelines(f"(raylet) {line}\n" for line in warnings)
                lines = [line for line in lines if not line.startswith(RAYLET_WARNING)]
                if not lines:
                    return
        original({**data, "lines": lines}, ignore_prefix)

    def handle(data: dict) -> None:
        lines = data.get("lines") or []
        if data.get("pid") in ("autoscaler", "raylet"):  # Ray filters these itself
            print_to_stdstream(data, ignore_prefix)
            return
        ours = [line for line in lines if line.startswith(CONSOLE_PREFIX)]
        rest = [line for line in lines if not line.startswith(CONSOLE_PREFIX)]
        if ours:  # not deduplicated: Ray would merge the progress lines of Tune trials
            sink = sys.stderr if data.get("is_err") else sys.stdout
            ray_worker.print_worker_logs({**data, "lines": ours}, sink, ignore_prefix)
        if rest:
            who = data.get("actor_name") or data.get("task_name") or ""
            head = f"({who} pid={data.get('pid')}) "
            with lock, open(log_file, "a") as f:
                f.writelines(head + line + "\n" for line in rest)

    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", handle)
    # The raylet's messages to the driver (ray._private.worker.listen_error_messages)
    # go through this module-level printer, not the dispatcher.
    ray_worker._trainlab_print_to_stdstream = original  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream
    return True


def plain_output_when_piped() -> None:
    """Ray wraps the prefix of each worker line it forwards in colour codes; where
    the output is not a terminal (a pipe, a file, CI) they are bytes in the text
    (`\x1b[36m(RayTrainWorker pid=...)\x1b[0m`). RAY_COLOR_PREFIX=0 (read by Ray
    each time it prints, so also after ray.init) leaves them out; a value the
    user set is kept."""
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


# Ray 2.60 turns token auth on for a new local cluster when RAY_AUTH_MODE is unset
# (making ~/.ray/auth_token if needed) and says so with a WARNING at every start.
# For the embedded cluster that is the intended, secure mode, not news: the notice
# is dropped. The opposite one ("Token authentication is disabled", the user set
# RAY_AUTH_MODE=disabled or connects without a token) is kept. Setting
# RAY_AUTH_MODE=token here instead would not do: Ray caches its config when
# imported, and a driver whose cache says "disabled" cannot reach a cluster it
# started with tokens.
_TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_TOKEN_AUTH_ENABLED = "Token authentication is enabled for this Ray cluster"


def quiet_token_auth_notice() -> None:
    """Drop Ray's notice that it enabled token auth (see _TOKEN_AUTH_ENABLED); once."""
    logger = logging.getLogger(_TOKEN_AUTH_LOGGER)
    if not any(isinstance(f, _DropMessages) for f in logger.filters):
        logger.addFilter(_DropMessages(_TOKEN_AUTH_ENABLED))


def ensure_ray(
    num_cpus: int | None = None,
    address: str | None = None,
    runtime_env: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Connect once per process; return `ray.cluster_resources()`.

    `address` (or RAY_ADDRESS, which the CLI sets to the running local cluster of
    `trainlab cluster up`) connects to an existing cluster. Otherwise a new
    local cluster is started with `address="local"`, never silently attaching to
    some other cluster that happens to run on this machine.
    """
    import ray

    plain_output_when_piped()
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or None
        kwargs: dict[str, Any] = {
            "logging_level": logging.WARNING,
            "log_to_driver": True,
            "configure_logging": True,
        }
        if address:
            if runtime_env:
                kwargs["runtime_env"] = runtime_env
            log.info("connecting to Ray at %s", address)
            if from_local_cluster(address):
                print(
                    f"Ray: the local cluster of `trainlab cluster up` at {address} "
                    "(RAY_ADDRESS names another)",
                    file=sys.stderr,
                    flush=True,
                )
            ray.init(address=address, **kwargs)
        else:
            quiet_token_auth_notice()
            kwargs["runtime_env"] = {
                "worker_process_setup_hook": "trainlab.raycluster.quiet_embedded_worker_logs",
                **(runtime_env or {}),
            }
            ray.init(
                address="local",
                num_cpus=local_num_cpus(num_cpus),
                include_dashboard=False,
                **kwargs,
            )
        if _routed_to is not None:  # a command asked for Ray's output in a file
            _apply_route(_routed_to)
    return ray.cluster_resources()


def normal_priority() -> None:
    """Ray runs its worker processes at nice 15 so its control plane stays responsive;
    training (the agent and its training process) and prep's workers are the node's
    main work, so they take back the normal priority when allowed. At nice 15 every nice-0 process on the node
    (Ray's log monitor, GCS, a user's shell) preempts it almost entirely."""
    with contextlib.suppress(OSError):  # lowering niceness needs CAP_SYS_NICE
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
