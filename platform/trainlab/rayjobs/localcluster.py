"""A local Ray cluster on this machine: `trainlab cluster up` / `down`.

The head is `ray start --head --block` run from this Python environment (a
job's `python` is whatever is first on the head's PATH), in its own process
group, bound to 127.0.0.1, with token authentication on and every port
chosen free (other clusters may run on this machine). Optional worker nodes
are more raylets joining it (`ray start --address`), each in its own process
group. What was started is recorded in a state file; `down` ends exactly those
process groups, by id, never Ray processes by name and never `ray stop` (which
would end every cluster on the machine).

Loopback only: every node runs in Ray's single-machine mode
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), which keeps every address on 127.0.0.1.
`ray start` refuses extra raylets in that mode and gives a node only 30 s to
register, so nodes start through `python -m trainlab.rayjobs.raynode start ...`:
Ray's own `ray start` with those two limits adjusted (see that module).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainlab.errors import UserError
from trainlab.home import home_dir
from trainlab.rayjobs.auth import ensure_token

HOST = "127.0.0.1"
DEFAULT_GCS_PORT = 6390
DEFAULT_DASHBOARD_PORT = 8290
READY_MARK = "Ray runtime started"
SINGLE_MACHINE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray's `ray start`, run from this environment with the adjustments of
# trainlab.rayjobs.raynode (extra loopback nodes allowed, patient registration).
RAY_START = [sys.executable, "-m", "trainlab.rayjobs.raynode", "start"]


def state_path() -> Path:
    return home_dir() / "cluster.json"


@dataclass
class NodeProc:
    """One `ray start --block` process group."""

    role: str  # "head" or "worker"
    pgid: int
    log: str
    num_cpus: int
    temp_dir: str = ""  # Ray's session files, logs and sockets of this node
    # With `scratch_per_node`: this node's trainlab scratch (TRAINLAB_SCRATCH_DIR of
    # its processes), as a machine of a cluster without a shared disk has its own.
    scratch_dir: str = ""


@dataclass
class ClusterState:
    gcs_address: str
    dashboard_url: str
    temp_dir: str
    nodes: list[NodeProc] = field(default_factory=list)
    started_at: float = 0.0
    scratch_per_node: bool = False

    @property
    def address(self) -> str:
        """The cluster's address as Ray names it (RAY_ADDRESS, `ray.init(address=)`):
        its head's GCS, HOST:PORT."""
        return self.gcs_address

    @property
    def head(self) -> NodeProc:
        return next(n for n in self.nodes if n.role == "head")

    @property
    def workers(self) -> list[NodeProc]:
        return [n for n in self.nodes if n.role == "worker"]

    def to_json(self) -> dict[str, Any]:
        """The state file's fields, and `address` first: what the commands print
        (`cluster up/status --json`)."""
        return {"address": self.address, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ClusterState:
        d = dict(d)
        nodes = [NodeProc(**n) for n in d.pop("nodes", [])]
        address = d.pop("address", None)
        d.setdefault("gcs_address", address)
        return cls(nodes=nodes, **d)


def read_state(path: Path | None = None) -> ClusterState | None:
    """The recorded local cluster if its head process group is still alive."""
    path = path or state_path()
    try:
        state = ClusterState.from_json(json.loads(path.read_text()))
    except (FileNotFoundError, ValueError, TypeError, KeyError):
        return None
    return state if group_alive(state.head.pgid) else None


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes of a process group (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces or parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


HEAD_GRACE_S = 1.0


def stop_group(pgid: int, grace_s: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after `grace_s`
    (`ray start --block` does not always stop its children on SIGTERM)."""
    stop_groups([pgid], grace_s)


def stop_groups(pgids: list[int], grace_s: float = 5.0) -> None:
    """`stop_group` of several process groups at once: they stop side by side (a
    cluster's worker nodes), not one after another."""
    left = list(pgids)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for pgid in list(left):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                left.remove(pgid)
        deadline = time.monotonic() + wait
        while left and time.monotonic() < deadline:
            left = [g for g in left if group_members(g)]
            if left:
                time.sleep(0.1)
        if not left:
            return


def _node_env(gcs_address: str, scratch_dir: str = "") -> dict[str, str]:
    """Environment of one node of the cluster at `gcs_address`. RAY_ADDRESS names that
    cluster to every process the node starts: Ray's own helpers that look the cluster
    up (the job supervisor, Ray Train's placement-group cleaner through the state API)
    would otherwise guess among every Ray instance on this machine, and fail, or pick
    another engineer's cluster, when there is more than one."""
    extra = {**SINGLE_MACHINE_ENV, "RAY_ADDRESS": gcs_address}
    if scratch_dir:  # every process Ray starts on the node inherits it
        from trainlab.nodedisk import SCRATCH_ENV_VAR

        extra[SCRATCH_ENV_VAR] = scratch_dir
    return _ray_env(extra)


def _ray_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # The job's `python` is the first on the head's PATH: make it this environment's.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["RAY_AUTH_MODE"] = "token"
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def _launch(cmd: list[str], log: Path, env: dict[str, str]) -> int:
    """Start `cmd` in a new session (so it leads its own process group); return the pgid."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    return proc.pid


def _wait_ready(pgid: int, log: Path, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if READY_MARK in text:
            return
        if not group_members(pgid):
            tail = "\n".join(text.strip().splitlines()[-5:])
            raise UserError(f"{what} exited while starting; last lines of {log}:\n{tail}")
        time.sleep(0.5)
    stop_group(pgid)
    raise UserError(f"{what} did not start within {timeout_s:.0f} s; see {log}")


def _agent_port_flags() -> list[str]:
    """Ports every raylet opens besides its own; Ray's fixed defaults (52365...)
    would collide with other clusters on this machine."""
    return [
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        f"--metrics-export-port={free_port()}",
    ]


def start_head(
    num_cpus: int,
    gcs_port: int,
    dashboard_port: int,
    temp_dir: Path,
    log: Path,
    timeout_s: float,
    scratch_dir: str = "",
) -> NodeProc:
    cmd = [
        *RAY_START,
        "--head",
        "--block",
        "--disable-usage-stats",
        f"--node-ip-address={HOST}",
        f"--port={gcs_port}",
        "--include-dashboard=true",
        f"--dashboard-host={HOST}",
        f"--dashboard-port={dashboard_port}",
        f"--ray-client-server-port={free_port()}",
        f"--num-cpus={num_cpus}",
        f"--temp-dir={temp_dir}",
        *_agent_port_flags(),
    ]
    pgid = _launch(cmd, log, _node_env(f"{HOST}:{gcs_port}", scratch_dir))
    _wait_ready(pgid, log, "the Ray head", timeout_s)
    return NodeProc("head", pgid, str(log), num_cpus, str(temp_dir), scratch_dir)


def start_worker(
    gcs_address: str,
    num_cpus: int,
    temp_dir: Path,
    log: Path,
    timeout_s: float,
    resources: dict[str, float] | None = None,
    scratch_dir: str = "",
    env: dict[str, str] | None = None,
) -> NodeProc:
    """One more raylet joining `gcs_address`. `env`: variables of this node only, which
    every process it starts inherits (e.g. a PYTHONPATH that shadows a package: a
    machine whose environment drifted from the lock, for the node check's test)."""
    # Its own temp dir: sharing the head's would make both nodes' log monitors
    # forward every worker log line, so a job's logs would show each line twice.
    cmd = [
        *RAY_START,
        "--block",
        "--disable-usage-stats",
        f"--address={gcs_address}",
        f"--node-ip-address={HOST}",
        f"--num-cpus={num_cpus}",
        f"--temp-dir={temp_dir}",
        *_agent_port_flags(),
    ]
    if resources:
        cmd.append(f"--resources={json.dumps(resources)}")
    pgid = _launch(cmd, log, {**_node_env(gcs_address, scratch_dir), **(env or {})})
    _wait_ready(pgid, log, "a Ray worker node", timeout_s)
    return NodeProc("worker", pgid, str(log), num_cpus, str(temp_dir), scratch_dir)


# --------------------------------------------------------------------------- up / down


def cluster_up(
    num_cpus: int | None = None,
    worker_nodes: int = 0,
    worker_cpus: int = 2,
    gcs_port: int | None = None,
    dashboard_port: int | None = None,
    timeout_s: float = 300.0,
    scratch_per_node: bool = False,
) -> ClusterState:
    """Start the head (and `worker_nodes` more raylets); record and return the state.
    `scratch_per_node`: each node gets its own trainlab scratch directory
    (`{its temp dir}-scratch`), as on a cluster whose machines share no disk: with
    runs and data in object storage, nothing may depend on another node's files."""
    from trainlab.raycluster import local_num_cpus

    if read_state() is not None:
        state = read_state()
        raise UserError(
            f"a local cluster is already running at {state.dashboard_url} "
            "(`trainlab cluster down` stops it)"
        )
    gcs_port = gcs_port or _pick(DEFAULT_GCS_PORT)
    dashboard_port = dashboard_port or _pick(DEFAULT_DASHBOARD_PORT)
    for name, port in (("--port", gcs_port), ("--dashboard-port", dashboard_port)):
        if not port_free(port):
            raise UserError(f"{name} {port}: already in use on {HOST}; choose another")
    ensure_token()
    home = home_dir()
    # Short path: Ray's unix sockets live under it (108-byte limit on Linux).
    temp_dir = Path(f"/tmp/trainlab-ray-{os.getuid()}-{gcs_port}")
    logs = home / "logs"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    state = ClusterState(
        gcs_address=f"{HOST}:{gcs_port}",
        dashboard_url=f"http://{HOST}:{dashboard_port}",
        temp_dir=str(temp_dir),
        started_at=time.time(),
        scratch_per_node=scratch_per_node,
    )
    for attempt in (1, 2):  # a second try on a machine too busy for the first
        try:
            head = start_head(
                local_num_cpus(num_cpus),
                gcs_port,
                dashboard_port,
                temp_dir,
                logs / f"head-{stamp}-{attempt}.log",
                timeout_s,
                scratch_dir=f"{temp_dir}-scratch" if scratch_per_node else "",
            )
            break
        except UserError:
            shutil.rmtree(temp_dir, ignore_errors=True)  # our own log of it stays in logs/
            if attempt == 2:
                raise
    state.nodes.append(head)
    _write_state(state)
    try:
        for _ in range(worker_nodes):
            add_worker_node(state, worker_cpus, timeout_s)
    except BaseException:
        cluster_down()
        raise
    return state


def add_worker_node(
    state: ClusterState, num_cpus: int = 2, timeout_s: float = 300.0, path: Path | None = None
) -> NodeProc:
    """Start one more raylet joining `state`'s head (more capacity, or a replacement
    after a failure) and record it. Ray gives a new node 30 s to register; on a
    loaded machine that can pass, so a node that timed out gets a second try."""
    index = len(state.nodes)
    temp_dir = Path(f"{state.temp_dir}-w{index}")
    for attempt in (1, 2):
        stamp = time.strftime("%Y%m%d-%H%M%S")
        try:
            node = start_worker(
                state.gcs_address,
                num_cpus,
                temp_dir,
                home_dir() / "logs" / f"worker{index}-{stamp}-{attempt}.log",
                timeout_s,
                resources={"trainlab_worker_node": 1},
                scratch_dir=f"{temp_dir}-scratch" if state.scratch_per_node else "",
            )
            break
        except UserError:
            shutil.rmtree(temp_dir, ignore_errors=True)  # its log is in home_dir()/logs
            if attempt == 2:
                raise
    state.nodes.append(node)
    _write_state(state, path)
    return node


def _pick(preferred: int) -> int:
    return preferred if port_free(preferred) else free_port()


def _write_state(state: ClusterState, path: Path | None = None) -> None:
    path = path or state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state.to_json(), indent=2))
    tmp.replace(path)


def cluster_down(path: Path | None = None, remove_temp_dirs: bool = False) -> ClusterState | None:
    """Stop the recorded cluster's process groups (workers first); None if none ran.
    Ray's temp dirs (its logs) stay unless `remove_temp_dirs`."""
    path = path or state_path()
    try:
        state = ClusterState.from_json(json.loads(path.read_text()))
    except (FileNotFoundError, ValueError, TypeError, KeyError):
        return None
    stop_groups([node.pgid for node in state.workers])  # workers first, side by side
    # The head's processes (GCS, its raylet, `ray start --block`) take SIGTERM and
    # then wait on peers that are gone: measured, none had exited after 6 s. It
    # holds nothing to save (no GCS persistence here), so it gets a short grace.
    stop_group(state.head.pgid, grace_s=HEAD_GRACE_S)
    if remove_temp_dirs:
        for node in state.nodes:
            if node.temp_dir:
                shutil.rmtree(node.temp_dir, ignore_errors=True)
    path.unlink(missing_ok=True)
    return state


def _raylet_pid(node: NodeProc) -> int:
    """The raylet of a node, looked up inside the node's own process group only."""
    for pid in group_members(node.pgid):
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if Path(exe).name == "raylet":
            return pid
    raise RuntimeError(f"no raylet in process group {node.pgid}")


def node_id(node: NodeProc) -> str:
    """Ray's id of a node we started (from its raylet's command line)."""
    args = Path(f"/proc/{_raylet_pid(node)}/cmdline").read_bytes().split(b"\0")
    for arg in args:
        if arg.startswith(b"--node_id="):
            return arg.split(b"=", 1)[1].decode()
    raise RuntimeError(f"raylet of process group {node.pgid} has no --node_id")


def kill_raylet(node: NodeProc) -> int:
    """SIGKILL the raylet of one node: the node is lost, as when a machine dies
    (for rehearsals and tests). Returns the raylet's pid."""
    pid = _raylet_pid(node)
    os.kill(pid, signal.SIGKILL)
    return pid


def trainlab_command(program: str = "trainlab") -> str:
    """How to run this environment's `program` (trainlab, ray) from the current
    directory, for the commands we suggest: the bare name when the shell finds this
    one on PATH, else its path (`.venv/bin/trainlab` from the repository root)."""
    exe = Path(sys.executable).parent / program
    found = shutil.which(program)
    if found and Path(found).resolve() == exe.resolve():
        return program
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)


DEMO_DATA = Path("data/demo/prepared/manifest.json")  # what the tiny recipe reads


def how_to_submit(state: ClusterState) -> list[str]:
    """The lines `cluster up` prints: where it is and what to run next."""
    tl = trainlab_command()
    workers = f" + {len(state.workers)} worker node(s)" if state.workers else ""
    lines = [
        f"Ray cluster up{workers}: address {state.address}, "
        f"dashboard and Jobs API {state.dashboard_url} (token auth on)",
        "trainlab's commands (train, tune, prep, submit, ...) use this cluster while "
        "it runs and RAY_ADDRESS is unset. Next:",
    ]
    if not DEMO_DATA.is_file():
        lines.append(
            f"  prepare: {DEMO_DATA.parent} is missing here; build it first "
            '(`make demo`, or the two commands under "Preparing data" in README.md)'
        )
    return [
        *lines,
        f"  submit:  {tl} submit trainers/recipes/tiny.yaml --follow",
        f"  jobs:    {tl} jobs",
        f"  records: {tl} runs   |   {tl} compare",
        f"  stop:    {tl} cluster down",
        "  (Ray's own `ray job submit` to this cluster: see cluster/README.md)",
    ]
