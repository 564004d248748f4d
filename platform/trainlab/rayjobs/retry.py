"""Job-level retry (`resource.job_retries`): infrastructure failures only.

A failure is *infrastructure* when nothing in the config or the code caused
it: the driver process was killed (a signal: the OOM killer, a lost node, a
preempted VM), the trainer reported that the cluster lost the nodes it needed
(exit code 75, EX_TEMPFAIL from sysexits.h, after Ray Train's own
`train.max_failures` restarts were used up), or Ray lost the job's supervisor
(the node running it died). Anything else, a config error (exit 2) or a bug
(exit 1), fails the same way every time and is never retried.

Two places retry, with the same rule:
- on the cluster, `python -m trainlab.rayjobs.retry --retries N -- CMD...` wraps the
  job's entrypoint and re-runs CMD after an infrastructure failure: it keeps
  working when nobody follows the job;
- `trainlab submit --follow` resubmits a job whose supervisor Ray lost (the
  wrapper died with it, so it could not retry).
A re-run is the same command with the same config, so the trainer resumes from
the run's newest valid checkpoint.

A re-run avoids the nodes blamed for the failure. When Ray Train gives up, the
trainer looks up where its training workers died (Ray's actor table: a worker
process or its node died, not a worker Ray Train stopped itself) and records
those node ids as `lost_nodes` in run_summary.json. The wrapper reads them from
the command's `--run-dir`, adds them to the nodes excluded so far, says which,
and gives them to the re-run in TRAINLAB_EXCLUDE_NODES; the trainer places its
workers with the label selector `ray.io/node-id: !in(...)`
(trainlab.train.driver.placement).
A machine whose raylet restarts comes back under a new node id and is used again.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainlab.train.driver.placement import EXCLUDE_ENV, excluded_nodes

EXIT_INFRASTRUCTURE = 75  # EX_TEMPFAIL: the trainer's "the cluster failed me"
STOPPED_BY_ALERT = 4  # trainlab.exitcodes: a P0 action stopped the run, never retried
# Ray job error types that mean the job's own supervisor was lost, not the code.
INFRASTRUCTURE_JOB_ERRORS = frozenset(
    {
        "JOB_SUPERVISOR_ACTOR_DIED",
        "JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE",
        "JOB_SUPERVISOR_ACTOR_START_TIMEOUT",
    }
)


def is_infrastructure_exit(returncode: int) -> bool:
    """A child exit code that calls for a retry: killed by a signal (subprocess
    reports -N; a shell in between reports SIGKILL, the OOM killer's, as 137),
    or EX_TEMPFAIL from the trainer."""
    return returncode < 0 or returncode in (EXIT_INFRASTRUCTURE, 128 + signal.SIGKILL)


def is_infrastructure_job_failure(error_type: str | None, driver_exit_code: int | None) -> bool:
    """For a FAILED Ray job: should it be resubmitted?"""
    if error_type in INFRASTRUCTURE_JOB_ERRORS:
        return True
    return driver_exit_code is not None and is_infrastructure_exit(driver_exit_code)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode == EXIT_INFRASTRUCTURE:
        return "the cluster lost resources the run needed (exit 75)"
    if returncode == STOPPED_BY_ALERT:
        return "stopped by an alert's action (exit 4): deliberate, not retried"
    return f"exit code {returncode}"


def run_dir_of(cmd: list[str]) -> str | None:
    """The `--run-dir` a trainer command was given (what a job retry passes)."""
    for i, arg in enumerate(cmd):
        if arg == "--run-dir" and i + 1 < len(cmd):
            return cmd[i + 1]
        if arg.startswith("--run-dir="):
            return arg.split("=", 1)[1]
    return None


def blamed_in(run_dir: Path | str | None) -> list[str]:
    """`lost_nodes` of the run's summary after a failed attempt ([] when none);
    the run may live in object storage (`--run-dir s3://...`)."""
    from trainlab.run.location import RunLocation

    if run_dir is None:
        return []
    try:
        summary = json.loads(RunLocation.of(run_dir).read_text("run_summary.json") or "")
    except (OSError, ValueError):
        return []
    nodes = summary.get("lost_nodes") if isinstance(summary, dict) else None
    return [str(n) for n in nodes] if isinstance(nodes, list) else []


class _Stop:
    """Set when the job is being stopped: a stopped job is never retried."""

    requested = False


def supervise(cmd: list[str], retries: int, pause_s: float = 5.0) -> int:
    """Run `cmd`; re-run it up to `retries` times after infrastructure failures."""
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: object) -> None:
        _Stop.requested = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    attempt = 0
    excluded = set(excluded_nodes())
    while True:
        attempt += 1
        env = {**os.environ, **({EXCLUDE_ENV: ",".join(sorted(excluded))} if excluded else {})}
        child = subprocess.Popen(cmd, env=env)
        rc = child.wait()
        if rc == 0 or _Stop.requested:
            return rc
        if not is_infrastructure_exit(rc):
            _say(
                f"attempt {attempt} failed ({describe_exit(rc)}): not an infrastructure "
                "failure, not retried"
            )
            return rc
        if attempt > retries:
            _say(
                f"attempt {attempt} failed ({describe_exit(rc)}); "
                f"resource.job_retries={retries} used up"
            )
            return 128 - rc if rc < 0 else rc  # a signal, as a shell reports it
        blamed = [n for n in blamed_in(run_dir_of(cmd)) if n not in excluded]
        excluded.update(blamed)
        avoid = (
            f"; excluding node(s) {', '.join(sorted(excluded))}"
            + (f" (lost attempt {attempt}'s workers: {', '.join(blamed)})" if blamed else "")
            if excluded
            else "; no node blamed"
        )
        _say(
            f"attempt {attempt} failed ({describe_exit(rc)}): infrastructure failure; "
            f"retry {attempt}/{retries} from the newest checkpoint in {pause_s:.0f} s{avoid}"
        )
        time.sleep(pause_s)


def _say(msg: str) -> None:
    print(f"[trainlab retry] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainlab.rayjobs.retry",
        description="Run CMD, retrying infrastructure failures.",
    )
    ap.add_argument("--retries", type=int, required=True)
    ap.add_argument("--pause", type=float, default=5.0, help="seconds between attempts")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command given (usage: --retries N -- CMD ...)")
    return supervise(cmd, args.retries, args.pause)


if __name__ == "__main__":
    sys.exit(main())
