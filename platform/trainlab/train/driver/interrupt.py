"""Ctrl-C in `trainlab train`'s driver.

A terminal sends SIGINT to its whole foreground process group. Ray's own
processes (raylet, workers, and the training processes forked below them)
block SIGINT, so only the driver sees it, and the driver decides:

- the first Ctrl-C asks the run to stop at the next step boundary: it creates the
  run's interrupt flag (trainlab.run.records), which rank 0's agent turns into
  a stop request; every rank reads it with a step's all-reduced signals (one step
  late, trainlab.train.loop.metrics) and stops at the same step; they checkpoint there
  when the newest checkpoint (or the start) is at least
  `train.checkpoint.on_interrupt_min_age_s` old (else the newest valid checkpoint
  is the resume point), write the summary with status "interrupted" and close
  the MLflow run, and `trainlab train` prints the command that resumes it and
  exits 130 (trainlab.exitcodes.INTERRUPTED);
- before the run directory exists there is nothing to stop cleanly, and during
  start-up (Ray starting, the workers placed, the training processes not past
  their first step since they last started) there is nothing to save: the first
  Ctrl-C ends the command at once, as a second would (a stop at the next step
  boundary would first wait for the whole start-up);
- a second Ctrl-C stops at once (`KeyboardInterrupt` in the driver, which marks
  the run interrupted at its newest valid checkpoint and shuts Ray down).

SIGTERM (what a scheduler, Kubernetes or a job runner sends first) is the same
graceful stop: the first stops at the next step boundary (with a checkpoint as
above), a second stops at once; the command then exits 143 (128 + SIGTERM)
instead of 130 (`exit_code`).

Ray Train installs a SIGINT handler of its own (it aborts the worker group at
once, and the run's records with it) when `fit()` runs on the main thread:
`call_in_thread` runs it on another thread, so this handler stays in charge.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from trainlab.exitcodes import INTERRUPTED, TERMINATED
from trainlab.run.records import RunRecords

T = TypeVar("T")
log = logging.getLogger(__name__)
JOIN_POLL_S = 0.2
FIT_THREAD = "trainlab-fit"  # call_in_thread's thread: Ray Train's fit, in ray.get
FIT_END_S = 10.0  # how long a stop at once waits for that thread to leave ray.get
_RUNNING: set[threading.Event] = set()  # the fits call_in_thread runs now (their end)
# How long a Ctrl-C waits for storage that does not answer (a store outage) before
# it stops at once; the interrupted summary after it waits as long.
INTERRUPT_STORE_WAIT_S = 3.0


SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """SIGINT and SIGTERM handling for the duration of a `with` block (main thread
    only; elsewhere, e.g. in a Tune trial, it does nothing)."""

    active: Interrupts | None = None  # the one handling the signals now
    # The signal that stopped the newest run of this process (None: none did).
    last_signal: int | None = None

    def __init__(self) -> None:
        self.count = 0
        self.records: RunRecords | None = None
        self.session: str | None = None
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
            self._installed = True
            Interrupts.active = self
            Interrupts.last_signal = None
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._installed:
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
            self._installed = False
            Interrupts.active = None

    @classmethod
    def reclaim(cls) -> None:
        """Install the handlers again: `ray.init` installs a C-level SIGTERM handler
        of its own (it prints "SIGTERM received" and kills the process), which
        replaces this one. Called after Ray started; main thread only."""
        active = cls.active
        if active is not None and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                signal.signal(sig, active._handle)

    @property
    def requested(self) -> bool:
        return self.count > 0

    @classmethod
    def requested_now(cls) -> bool:
        """A Ctrl-C reached the active handler (False where none is installed)."""
        return cls.active is not None and cls.active.requested

    def attach(self, run_dir: Any, session: str | None = None) -> None:
        """From now on a first Ctrl-C stops this run at its next step boundary, once
        the training processes of `session` (this start) are past a step; before,
        it ends the command at once (without `session`: always the step boundary)."""
        self.records = RunRecords(run_dir)
        self.session = session
        if self.count:
            self.records.request_interrupt()

    def training(self) -> bool:
        """The training processes of this start completed a step since their newest
        (re)start: a stop at the next step boundary is near and can keep their work."""
        if self.records is None:
            return False
        if self.session is None:
            return True
        started = [a for a in self.records.attempts() if a.get("session") == self.session]
        stepped = [a for a in self.records.first_steps() if a.get("session") == self.session]
        return bool(started) and len(stepped) >= len(started)

    @staticmethod
    def exit_code() -> int:
        """What a stopped command exits with: 143 after SIGTERM, else 130."""
        return TERMINATED if Interrupts.last_signal == signal.SIGTERM else INTERRUPTED

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        Interrupts.last_signal = signum
        what = "SIGTERM" if signum == signal.SIGTERM else "interrupt"
        again = "send SIGTERM" if signum == signal.SIGTERM else "press Ctrl-C"
        if self.records is None or self.count > 1:
            raise KeyboardInterrupt
        from trainlab.location.errors import retry_budget

        try:
            with retry_budget(INTERRUPT_STORE_WAIT_S):
                training = self.training()
                if training:
                    self.records.request_interrupt()
        except OSError as e:  # the stop is asked through the run's storage: unreachable
            print(
                f"\n{what}: the run's storage does not answer ({e}); stopping now "
                "(a resume continues from the newest valid checkpoint)",
                file=sys.stderr,
                flush=True,
            )
            raise KeyboardInterrupt from None
        if not training:
            print(
                f"\n{what}: still starting (nothing trained since this start): stopping now",
                file=sys.stderr,
                flush=True,
            )
            raise KeyboardInterrupt
        print(
            f"\n{what}: stopping after the next step (with a checkpoint unless the newest "
            "is recent: train.checkpoint.on_interrupt_min_age_s); "
            f"{again} again to stop at once",
            file=sys.stderr,
            flush=True,
        )


def call_in_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a daemon thread while the main thread waits, so that signals are
    handled by the main thread's handlers (a KeyboardInterrupt they raise leaves
    `fn` running on its thread); `fn`'s exception is re-raised here.

    The main thread waits on an Event, never in `Thread.join`: CPython 3.11's
    join, interrupted by a KeyboardInterrupt while the thread runs, releases the
    running thread's own state lock and marks it stopped (seen in a core dump:
    `_is_stopped=True, _tstate_lock=None` on a thread still inside `ray.get`), so
    nothing could tell afterwards that it still ran."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            box["error"] = e
        finally:
            done.set()
            _RUNNING.discard(done)

    _RUNNING.add(done)
    thread = threading.Thread(target=target, name=FIT_THREAD, daemon=True)
    thread.start()
    while not done.wait(JOIN_POLL_S):
        pass
    if "error" in box:
        raise box["error"]
    return box["value"]


def end_fit_then_shutdown(ray: Any) -> None:
    """Ray's shutdown after a stop at once, with no thread of this driver inside
    `ray.get`: the fit thread (call_in_thread) waits there on Ray Train's
    controller, and `ray.shutdown()` frees what that wait reads. Measured: the
    driver died of SIGSEGV in 1 run of 17 of the Ctrl-C-in-a-store-outage test,
    in CoreWorkerMemoryStore::GetImpl on the fit thread. So the controller of
    this driver's job (on this node: Ray Train places it with the driver) is
    killed first; its workers end with it (Ray ends the actors an actor owns),
    the fit thread's `ray.get` raises, and Ray shuts down once the fit has
    returned (else Ray is left to end with this process, which a CLI does at
    once: Ray's processes of a local cluster end with their driver)."""
    running = [done for done in list(_RUNNING) if not done.is_set()]
    if running:
        # Polled, not asked once: a controller still being created (its process
        # starting, which takes seconds on a busy node) is not ALIVE yet and cannot
        # be killed; it is killed as soon as it is (measured: 8 of 30 stops under
        # load came before the controller was up).
        killed: set[int] = set()
        deadline = time.monotonic() + FIT_END_S
        while not all(done.is_set() for done in running) and time.monotonic() < deadline:
            _kill_controllers(ray, killed)
            waiting = next(done for done in running if not done.is_set())
            waiting.wait(min(JOIN_POLL_S, max(0.0, deadline - time.monotonic())))
        if not all(done.is_set() for done in running):
            log.warning(
                "Ray Train's fit did not end in %.0f s; Ray ends with this process", FIT_END_S
            )
            return
    ray.shutdown()


def _kill_controllers(ray: Any, killed: set[int]) -> None:
    """SIGKILL the ALIVE TrainControllers of this driver's job on this node that
    are not in `killed` (their pids, updated)."""
    try:
        from ray._private import state  # the GCS's actor table (no dashboard needed)

        ctx = ray.get_runtime_context()
        job, node = ctx.get_job_id(), ctx.get_node_id()
        # Filtered by the GCS (this job's live actors): a long-lived cluster's actor
        # table holds every actor it ever ran.
        alive = state.actors(job_id=ray.JobID.from_hex(job), actor_state_name="ALIVE")
        for info in alive.values():
            pid = int(info.get("Pid") or 0)
            if (
                info.get("ActorClassName") == "TrainController"
                and info.get("JobID") == job
                and info.get("State") == "ALIVE"
                and (info.get("Address") or {}).get("NodeID") == node
                and pid
                and pid not in killed
            ):
                killed.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    except Exception as e:  # noqa: BLE001 - the GCS gone: nothing to wait for
        log.debug("could not end Ray Train's controller: %s", e)
