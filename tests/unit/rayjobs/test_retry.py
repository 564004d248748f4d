"""resource.job_retries: infrastructure failures are retried, config and code
errors are not; the wrapper re-runs the same command (real processes, no Ray)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainlab.rayjobs.retry import (
    EXIT_INFRASTRUCTURE,
    is_infrastructure_exit,
    is_infrastructure_job_failure,
)

# A child that fails in a chosen way on its first N runs, then succeeds; it
# counts its attempts in a file, as a resumed trainer would find its checkpoint.
CHILD = r"""
import os, signal, sys
from pathlib import Path
counter = Path(sys.argv[1]); mode = sys.argv[2]; fail_times = int(sys.argv[3])
n = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(n + 1))
if n < fail_times:
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(mode))
print("done after", n + 1, "attempts")
"""


def _run(tmp_path: Path, mode: str, fail_times: int, retries: int):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    counter = tmp_path / "attempts"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainlab.rayjobs.retry",
            f"--retries={retries}",
            "--pause=0",
            "--",
            sys.executable,
            str(script),
            str(counter),
            mode,
            str(fail_times),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, int(counter.read_text())


def test_a_killed_driver_is_rerun_until_it_succeeds(tmp_path):
    proc, attempts = _run(tmp_path, "sigkill", fail_times=2, retries=2)
    assert proc.returncode == 0, proc.stderr
    assert attempts == 3
    assert "killed by SIGKILL" in proc.stderr and "retry 2/2" in proc.stderr


def test_tempfail_from_the_trainer_is_retried(tmp_path):
    proc, attempts = _run(tmp_path, str(EXIT_INFRASTRUCTURE), fail_times=1, retries=1)
    assert (proc.returncode, attempts) == (0, 2)


@pytest.mark.parametrize("code", [1, 2])
def test_code_and_config_errors_are_not_retried(tmp_path, code):
    proc, attempts = _run(tmp_path, str(code), fail_times=5, retries=3)
    assert (proc.returncode, attempts) == (code, 1)
    assert "not an infrastructure failure" in proc.stderr


def test_retries_are_bounded(tmp_path):
    proc, attempts = _run(tmp_path, "sigkill", fail_times=10, retries=2)
    assert proc.returncode == 137  # 128 + SIGKILL, as a shell reports it
    assert attempts == 3
    assert "job_retries=2 used up" in proc.stderr


def test_classification_of_ray_job_failures():
    assert is_infrastructure_job_failure("JOB_SUPERVISOR_ACTOR_DIED", None)
    assert is_infrastructure_job_failure("JOB_ENTRYPOINT_COMMAND_ERROR", -9)
    assert is_infrastructure_job_failure("JOB_ENTRYPOINT_COMMAND_ERROR", 137)
    assert not is_infrastructure_job_failure("JOB_ENTRYPOINT_COMMAND_ERROR", 1)
    assert not is_infrastructure_job_failure("JOB_ENTRYPOINT_COMMAND_ERROR", 2)
    assert not is_infrastructure_job_failure("RUNTIME_ENV_SETUP_FAILURE", None)
    assert not is_infrastructure_exit(130)  # interrupted by the user
