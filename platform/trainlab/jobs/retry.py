"""Job-level retry (`resource.job_retries`): infrastructure failures only.

A failure is *infrastructure* when nothing in the config or the code caused
it: the driver process was killed (a signal: the OOM killer, a lost node, a
preempted VM), the trainer reported that the cluster lost the nodes it needed
(exit code 75, EX_TEMPFAIL from sysexits.h, after Ray Train's own
`train.max_failures` restarts were used up), or Ray lost the job's supervisor
(the node running it died). Anything else, a config error (exit 2) or a bug
(exit 1), fails the same way every time and is never retried.

Two places retry, with the same rule:
- on the cluster, `python -m trainlab.jobs.retry --retries N -- CMD...` wraps the
  job's entrypoint and re-runs CMD after an infrastructure failure: it keeps
  working when nobody follows the job;
- `trainlab submit --follow` resubmits a job whose supervisor Ray lost (the
  wrapper died with it, so it could not retry).
A re-run is the same command with the same config, so the trainer resumes from
the run's newest valid checkpoint.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

EXIT_INFRASTRUCTURE = 75  # EX_TEMPFAIL: the trainer's "the cluster failed me"
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
    return f"exit code {returncode}"


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
    while True:
        attempt += 1
        child = subprocess.Popen(cmd)
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
        _say(
            f"attempt {attempt} failed ({describe_exit(rc)}): infrastructure failure; "
            f"retry {attempt}/{retries} from the newest checkpoint in {pause_s:.0f} s"
        )
        time.sleep(pause_s)


def _say(msg: str) -> None:
    print(f"[trainlab retry] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainlab.jobs.retry",
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
