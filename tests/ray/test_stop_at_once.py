"""A stop at once (a second Ctrl-C, one during start-up or in a store outage)
ends Ray Train's controller before Ray's shutdown, so that no thread of the
driver is inside `ray.get` when Ray frees what that wait reads (a driver died of
SIGSEGV there: trainlab.train.driver.interrupt.end_fit_then_shutdown). The
Ctrl-C lands while the main thread waits for the fit, as in `trainlab train`:
waiting in Thread.join, CPython 3.11 then took the running fit thread for
stopped, and the controller was never ended."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.ray]

DRIVER = textwrap.dedent(
    """
    import faulthandler, os, signal, sys, threading, time
    import ray
    from trainlab.train.driver.interrupt import call_in_thread, end_fit_then_shutdown

    faulthandler.dump_traceback_later(90, exit=True)  # a hang shows where
    # Python's own Ctrl-C handler, as `trainlab train` installs its own: a process
    # started from a job in the background (`make test &`) inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ray.init(address="auto", log_to_driver=False)

    @ray.remote(num_cpus=0)
    class TrainController:  # what Ray Train's fit waits on, here forever
        def __init__(self, start_s):
            time.sleep(start_s)  # its process starting, on a busy node

        def run(self):
            time.sleep(3600)

    controller = TrainController.remote(float(sys.argv[1]))
    seen = {}

    def fit():
        try:
            ray.get(controller.run.remote())
        except Exception as e:
            seen["error"] = type(e).__name__

    # Ctrl-C while the main thread waits for the fit (as `trainlab train` does)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        call_in_thread(fit)
    except KeyboardInterrupt:
        pass
    t0 = time.monotonic()
    end_fit_then_shutdown(ray)
    print("fit's error:", seen.get("error"), "| ray up:", ray.is_initialized(),
          "| took %.1f s" % (time.monotonic() - t0))
    """
)


@pytest.mark.parametrize("controller_start_s", [0, 3], ids=["controller_up", "controller_starting"])
def test_a_stop_at_once_ends_the_controller_and_the_fit_thread_before_ray_shuts_down(
    ray_cluster, controller_start_s
):
    """The Ctrl-C comes 1 s after the fit began: with the controller up, or while
    it is still being created (not yet ALIVE: it is ended once it is)."""
    import ray

    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(controller_start_s)], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("fit's error:")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    assert line[0].startswith("fit's error: ActorDiedError | ray up: False"), line[0]
