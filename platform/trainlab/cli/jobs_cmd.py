"""`trainlab submit | jobs | stop | cluster up/down/add-node`: orchestration on Ray clusters.

Progress goes to stderr; stdout carries the result (the job id, a table) or,
with --json, one JSON object on its last line.
"""

from __future__ import annotations

import os
import sys

import click

from trainlab.cli.common import config_args, echo_json, json_option
from trainlab.runstatus import RunStatus


def _address_option(fn):  # noqa: ANN001, ANN202 - click decorator
    return click.option(
        "--address",
        default=None,
        metavar="URL",
        help="Jobs API of the cluster, e.g. http://127.0.0.1:8290 (`trainlab cluster up`'s "
        "port; 8265 for `ray start`) (default: "
        "RAY_API_SERVER_ADDRESS, RAY_ADDRESS if a URL, or `trainlab cluster up`'s).",
    )(fn)


def _plain_http_option(fn):  # noqa: ANN001, ANN202 - click decorator
    return click.option(
        "--allow-plain-http",
        is_flag=True,
        help="Send the cluster's auth token to a non-local http:// address (in clear "
        "text; refused otherwise: use https:// or an SSH tunnel to 127.0.0.1).",
    )(fn)


def _err(msg: str) -> None:
    click.echo(msg, err=True)


@click.command()
@config_args
@_address_option
@click.option(
    "--smoke-first",
    is_flag=True,
    help="Rehearse the config with --smoke as a job on the cluster first; "
    "submit only if it passes.",
)
@click.option(
    "--follow", is_flag=True, help="Stream the job's logs until it ends; exit with its outcome."
)
@click.option(
    "--use-cluster-library",
    is_flag=True,
    help="The cluster image has trainlab installed: do not ship platform/trainlab.",
)
@_plain_http_option
@click.option(
    "--allow-env-drift",
    is_flag=True,
    help="Start even when a node's packages differ from the lock; the drift is recorded.",
)
@json_option
def submit(
    config: str,
    overrides: tuple[str, ...],
    address: str | None,
    smoke_first: bool,
    follow: bool,
    use_cluster_library: bool,
    allow_plain_http: bool,
    allow_env_drift: bool,
    as_json: bool,
) -> int:
    """Validate, plan, check and submit CONFIG as a Ray job; print its job id."""
    from trainlab.raycluster import LineRouter, command_log
    from trainlab.rayjobs.submit import submit as run_submit

    if allow_env_drift:  # forwarded to the job (trainlab.rayjobs.runtime_env)
        os.environ["TRAINLAB_ALLOW_ENV_DRIFT"] = "1"

    # Logs go to stdout unless stdout is reserved for the JSON result; Ray's own
    # lines in them go to a log file (trainlab.raycluster.LineRouter).
    stream = sys.stderr if as_json else sys.stdout
    router = LineRouter(lambda s: _write(stream, s), command_log("submit"))
    write_logs = router.write
    try:
        result = run_submit(
            config,
            overrides,
            address=address,
            smoke_first=smoke_first,
            follow=follow,
            ship_library=not use_cluster_library,
            allow_plain_http=allow_plain_http,
            say=_err,
            write_logs=write_logs,
        )
    finally:
        router.close()
    if router.routed:
        _err(f"(Ray's own lines of the job's log: {router.log_file})")
    if as_json:
        echo_json(result.to_json())
    else:
        click.echo(result.job_id)
    return result.exit_code


def _write(stream, text: str) -> None:  # noqa: ANN001 - a text stream
    stream.write(text)
    stream.flush()


@click.command()
@_address_option
@_plain_http_option
@json_option
def jobs(address: str | None, allow_plain_http: bool, as_json: bool) -> int:
    """List the cluster's jobs, newest first, with their status."""
    from trainlab.rayjobs.client import connect, list_jobs

    rows = list_jobs(connect(address, allow_plain_http=allow_plain_http))
    if as_json:
        echo_json([r.to_json() for r in rows])
        return 0
    if not rows:
        click.echo("no jobs")
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(show_header=True, header_style="bold")
    for col in ("job id", "status", "name", "kind", "started", "duration", "message"):
        t.add_column(col)
    for r in rows:
        t.add_row(
            r.job_id,
            r.status,
            r.name or "-",
            r.kind or "-",
            _clock(r.start_time),
            f"{r.duration_s:.0f} s" if r.duration_s is not None else "-",
            r.message[:60],
        )
    Console(width=160).print(t)
    return 0


def _clock(ts: float | None) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


@click.command()
@click.argument("job_id")
@_address_option
@_plain_http_option
@json_option
def stop(job_id: str, address: str | None, allow_plain_http: bool, as_json: bool) -> int:
    """Stop JOB_ID (its workers are released; checkpoints already written stay).
    The run it trained is marked `stopped` (run_summary.json; MLflow status KILLED).
    A job that had ended is left as it was; its run is said as it ended, or
    marked `lost` when nothing recorded its end (its driver was killed)."""
    from trainlab.rayjobs.client import TERMINAL, connect, job_info, resolve_address, stop_job

    url = resolve_address(address)
    client = connect(url, allow_plain_http=allow_plain_http)
    before = job_info(client, job_id)
    ended_before = str(getattr(before.status, "value", before.status)) in TERMINAL
    status = stop_job(client, job_id)
    if ended_before:  # nothing to stop: its run as it ended, `lost` when unrecorded
        gone = f"its job {job_id} had ended ({status}) leaving no ending of the run"
        run = _end_stopped_run(before, job_id, RunStatus.LOST, gone)
    elif status == "STOPPED":
        run = _end_stopped_run(job_info(client, job_id), job_id)
    else:
        run = None
    if as_json:
        echo_json(
            {"job_id": job_id, "address": url, "status": status,
             "already_ended": ended_before, "run": run}
        )  # fmt: skip
    else:
        click.echo(
            f"{job_id} {status}" + (" (it had ended: nothing to stop)" if ended_before else "")
        )
        if run is not None:
            click.echo(stopped_line(run, already_ended=ended_before))
    return 0


def stopped_line(run: dict, already_ended: bool = False) -> str:
    """What `trainlab stop` says of the run it ended (or, `already_ended`, of the
    run of a job that had ended before): the step it reached and what a resume
    keeps of it (the newest valid checkpoint's step, or nothing: step 0)."""
    import re

    where, step = run["run_dir"], run.get("final_step") or 0
    last = run.get("last_checkpoint")
    found = re.search(r"step-(\d+)$", str(last or "").rstrip("/"))
    if found is None:
        kept = "no checkpoint was kept: a resume starts at step 0"
    else:
        kept_step = int(found.group(1))
        dropped = f", steps {kept_step + 1}-{step} are dropped" if step > kept_step else ""
        kept = f"kept: its checkpoint at step {kept_step}{dropped}"
    status = run.get("status") or RunStatus.STOPPED
    if already_ended:
        ended = f"ended before the stop ({status})"
    elif status == RunStatus.STOPPED:
        ended = "marked stopped"
    else:
        ended = f"ended by its own processes ({status}: they took the stop)"
    return f"  run {where}: {ended} at step {step}; {kept}; resume with: trainlab train {where} --resume"


def _end_stopped_run(
    info: object, job_id: str, status: str = RunStatus.STOPPED, reason: str | None = None
) -> dict | None:
    """The stopped job's run, marked `stopped` (its killed processes could not);
    a run whose own processes took the stop (the driver's SIGTERM: a graceful stop
    at the next step, status `interrupted`) is left as they ended it, and its
    summary returned, so what a resume keeps is said either way. A job that had
    ended before the stop leaves its run as it ended, or `lost` (`status`) when
    nothing recorded its end (its driver was killed)."""
    from trainlab.run.records import RunRecords
    from trainlab.track.lifecycle import end_run, run_dir_of_job

    run_dir = run_dir_of_job(getattr(info, "metadata", None))
    if run_dir is None:
        return None
    try:
        ended = end_run(run_dir, status, reason or f"stopped by trainlab stop {job_id}")
        return ended or {"run_dir": run_dir, **(RunRecords(run_dir).read_summary() or {})}
    except OSError as e:  # the run directory is on storage this machine does not see
        click.echo(f"  could not mark the run in {run_dir} stopped: {e}", err=True)
        return None


@click.group()
def cluster() -> None:
    """Start or stop a local Ray cluster (head on 127.0.0.1, token auth on)."""


@cluster.command()
@click.option(
    "--num-cpus",
    type=click.IntRange(1, 4096),
    default=None,
    help="Logical CPUs of the head (default max(8, 2 x cores): training workers "
    "and Ray Data must not starve each other).",
)
@click.option(
    "--worker-nodes",
    type=click.IntRange(0, 16),
    default=0,
    help="Extra raylets on this machine (rehearse multi-node runs).",
)
@click.option(
    "--worker-cpus",
    type=click.IntRange(1, 4096),
    default=2,
    help="Logical CPUs of each worker node.",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Head (GCS) port (default 6390, or a free one).",
)
@click.option(
    "--dashboard-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Dashboard / Jobs API port (default 8290, or a free one).",
)
@click.option(
    "--scratch-per-node",
    is_flag=True,
    help="Give each node its own trainlab scratch directory (TRAINLAB_SCRATCH_DIR), "
    "as machines without a shared disk have: rehearse runs and data in object storage.",
)
@json_option
def up(
    num_cpus: int | None,
    worker_nodes: int,
    worker_cpus: int,
    port: int | None,
    dashboard_port: int | None,
    scratch_per_node: bool,
    as_json: bool,
) -> int:
    """Start a local Ray head node from this environment; print where it is."""
    from trainlab.rayjobs.localcluster import cluster_up, how_to_submit

    _err("starting the Ray head on 127.0.0.1 (token auth on); this takes 10-30 s ...")
    state = cluster_up(
        num_cpus=num_cpus,
        worker_nodes=worker_nodes,
        worker_cpus=worker_cpus,
        gcs_port=port,
        dashboard_port=dashboard_port,
        scratch_per_node=scratch_per_node,
    )
    if as_json:
        echo_json(state.to_json())
    else:
        for line in how_to_submit(state):
            click.echo(line)
    return 0


@cluster.command()
@json_option
def down(as_json: bool) -> int:
    """Stop the local cluster started by `trainlab cluster up` (by process group id)."""
    from trainlab.rayjobs.localcluster import cluster_down

    state = cluster_down()
    if as_json:
        echo_json(
            {"stopped": state is not None, "dashboard_url": state.dashboard_url if state else None}
        )
    elif state is None:
        click.echo("no local cluster is running")
    else:
        click.echo(
            f"stopped the local cluster at {state.dashboard_url} "
            f"({len(state.nodes)} node(s)); Ray's logs stay in {state.temp_dir}"
        )
    return 0


@cluster.command(name="add-node")
@click.option(
    "--num-cpus",
    type=click.IntRange(1, 4096),
    default=2,
    help="Logical CPUs of the new node.",
)
@json_option
def add_node(num_cpus: int, as_json: bool) -> int:
    """Start one more raylet joining the local cluster: capacity back after a lost
    node (an elastic run grows back to it: docs/elastic.md)."""
    from trainlab.errors import UserError
    from trainlab.rayjobs.localcluster import add_worker_node, read_state

    state = read_state()
    if state is None:
        raise UserError("no local cluster is running (`trainlab cluster up` starts one)")
    _err(f"starting a worker node with {num_cpus} CPU(s), joining {state.address} ...")
    node = add_worker_node(state, num_cpus)
    if as_json:
        echo_json(
            {"address": state.address, "gcs_address": state.gcs_address, "node": node.__dict__}
        )
    else:
        click.echo(f"worker node up ({num_cpus} CPU(s)), joined {state.address}; log {node.log}")
    return 0


@cluster.command()
@json_option
def status(as_json: bool) -> int:
    """Show the local cluster started by `trainlab cluster up`, if any."""
    from trainlab.rayjobs.localcluster import how_to_submit, read_state

    state = read_state()
    if as_json:
        echo_json(state.to_json() if state else None)
    elif state is None:
        click.echo("no local cluster is running (`trainlab cluster up` starts one)")
    else:
        for line in how_to_submit(state):
            click.echo(line)
    return 0
