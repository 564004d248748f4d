"""Fast restarts: each Ray Train worker is the agent of a training process.

Why: when a worker dies, Ray Train tears the whole worker group down and
builds a new one: new actor processes that import torch and Ray Train again,
a new process group, the data pipeline and the experiment record set up
again. On a 2-core machine that is 15-30 s per failure. Here the Ray Train
worker ("agent") stays up and runs the compute in a child process forked from
a warm fork server (torch already imported). When a training process dies,
every agent stops its own, they agree on a new rendezvous and fork new ones,
which resume from the newest valid checkpoint: a restart costs a process-group
setup and a checkpoint load.

What lives where:

- agent (this module; one per rank): the data stream (`trainlab.data.WorkerLoader`,
  Ray Data included), the callbacks on rank 0 (MLflow survives restarts), the
  failure records and the failure budget.
- training process (trainlab.train.supervision.child): model, optimizer, process group,
  checkpoints; it asks its agent for batches and forwards callback hooks over a
  pipe (trainlab.train.supervision.protocol).

The agent knows nothing of Ray: the worker (trainlab.train.driver.worker) hands it a
`Rendezvous` over Ray Train's collectives; tests hand it `LocalRendezvous`, a
fake child target and a multiprocessing context of their own.

An agent that dies (node lost, actor killed) is still handled by Ray Train:
`FailureConfig(max_failures)` restarts the group, which resumes the same way
(trainlab.train.supervision.failures). Both kinds of failure count against
`train.max_failures` (logs/failures.jsonl).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from trainlab.run import checkpoints as ckpts
from trainlab.run.records import (
    COMPONENT,
    INTERRUPT_REASON,
    STORAGE,
    Failure,
    RunRecords,
)
from trainlab.train.job import TrainJob
from trainlab.train.loop.callbacks import Callback
from trainlab.train.summaries import failed_summary
from trainlab.train.supervision.protocol import (
    PREFETCH_STEPS,
    ChildArgs,
    Done,
    Failed,
    Hook,
    IterFrom,
    LoaderCall,
    NextStep,
    Reply,
    Request,
    StopRequest,
)

log = logging.getLogger("trainlab.train")

POLL_S = 0.05

# Modules the fork server imports once, so that a training process starts warm.
PRELOAD = ("trainlab.train.loop.trainer", "trainlab.train.supervision.child")

# Collective errors that only say a peer went away: the cause is the peer's failure.
PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Socket Timeout",
    "NCCL communicator was aborted",
)


# What a training process reports when the run's disk failed a write (its trainer
# recorded the failure and, on rank 0, the failed summary: trainlab.train.loop.trainer).
STORAGE_FAULT = "StorageFault: "


# What a training process reports when a user's component had a bug in a hook
# (trainlab.train.loop.components.ComponentError).
COMPONENT_ERROR = "ComponentError: "


def error_kind(message: str) -> str:
    """`storage` when a write of the run's disk failed, `component` when a user's
    component had a programming error, `peer` when a training process failed
    because another one died, else `error`."""
    if message.startswith(STORAGE_FAULT):
        return STORAGE
    if message.startswith(COMPONENT_ERROR):
        return COMPONENT
    return "peer" if any(s in message for s in PEER_LOST) else "error"


def orphan_check_s() -> float:
    """How often an agent checks that its group's driver still holds the run
    (TrainJob.orphaned; TRAINLAB_ORPHAN_CHECK_S, default 10 s)."""
    return float(os.environ.get("TRAINLAB_ORPHAN_CHECK_S") or 10.0)


# --------------------------------------------------------------------------- rendezvous



# After a read of the failed flag that storage did not answer, the next one waits this long.
OUTAGE_PAUSE_S = 2.0


class FailedFlag:
    """The flag an attempt's agents share: set by the first whose training process
    failed, seen by the others, which stop theirs. It lives with the run's records
    (a file, or an object in the store); it is read at most every
    `Location.poll_interval_s`: at every poll of the pipe on a disk, every 0.5 s
    in a store. After a read that storage did not answer, the next waits
    OUTAGE_PAUSE_S."""

    def __init__(self, records: RunRecords, event: str):
        self.records, self.event = records, event
        self._every = records.loc.home.poll_interval_s
        self._checked, self._set = 0.0, False
        self._warned = float("-inf")

    def exists(self) -> bool:
        if self._set:
            return True
        now = time.monotonic()
        if now - self._checked < self._every:
            return False
        self._checked = now
        try:
            self._set = self.records.attempt_failed(self.event)
        except OSError as e:  # storage that does not answer says no rank failed
            if now - self._warned >= 60.0:  # once a minute at most
                self._warned = now
                log.warning("the attempt's failed flag was not read (%s); looked at again", e)
            self._checked = now + OUTAGE_PAUSE_S
        return self._set

    def touch(self) -> None:
        self._set = True
        try:
            self.records.mark_attempt_failed(self.event)
        except OSError as e:  # the other ranks see their peer gone through the collectives
            log.warning("the attempt's failed flag was not written (%s)", e)

class Rendezvous(Protocol):
    """How the agents of a run agree on each attempt (collectives between agents)."""

    def rendezvous(self, attempt: int, group: str | None) -> tuple[str, int, str]:
        """(address, port, group) of the attempt's process group, the same on every
        rank: rank 0 picks them. `group` is the previous attempt's (None at first)."""
        ...

    def barrier(self) -> None:
        """Return when every agent got here (each one's training process has ended)."""
        ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class LocalRendezvous:
    """One agent alone (world size 1): no collectives. For tests and single-process runs."""

    def __init__(self, addr: str = "127.0.0.1", group: str | None = None):
        self.addr, self.group = addr, group

    def rendezvous(self, attempt: int, group: str | None) -> tuple[str, int, str]:
        return self.addr, free_port(), group or self.group or uuid.uuid4().hex[:8]

    def barrier(self) -> None:
        pass


# --------------------------------------------------------------------------- fork server


def start_fork_server(deterministic: bool) -> Any:
    """The multiprocessing context whose fork server has torch and the training loop
    imported; started now so that its imports overlap the agent's own setup."""
    import multiprocessing.forkserver

    ctx = mp.get_context("forkserver")
    preload = list(PRELOAD)
    if deterministic:
        preload.append("torch._inductor.config")  # torch.use_deterministic_algorithms needs it
    ctx.set_forkserver_preload(preload)
    multiprocessing.forkserver.ensure_running()
    return ctx


# --------------------------------------------------------------------------- data


class Feeder:
    """Prefetches the stream's steps so the training process never waits on the
    agent's data pipeline more than it must: PREFETCH_STEPS pulls are queued on one
    thread (in order: one worker), each pull taking the next step of the stream."""

    def __init__(self, loader: Any, step: int):
        self._loader, self._start = loader, step
        self._stream: Any = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"feeder-{step}")
        self._ahead: deque[Future] = deque(
            self._pool.submit(self._pull) for _ in range(PREFETCH_STEPS)
        )
        self.ended = False

    def _pull(self) -> Any:
        if self._stream is None:  # in the pool's thread, like every step of the stream
            self._stream = iter(self._loader.iter_from(self._start))
        return next(self._stream, None)

    def next(self) -> Any:
        """The next (step, micro_batches), or None at the end of the stream (again and
        again: the training process may ask ahead)."""
        if self.ended:
            return None
        try:
            item = self._ahead.popleft().result()
        except BaseException as e:  # noqa: BLE001 - handed to the training process
            self.ended = True
            self.stop()
            raise RuntimeError(f"data stream failed: {type(e).__name__}: {e}") from e
        if item is None:
            self.ended = True
            self.stop()
            return None
        self._ahead.append(self._pool.submit(self._pull))
        return item

    def stop(self) -> None:
        """No more pulls: queued ones are cancelled, a running one finishes alone."""
        self._pool.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------- the agent


class Agent:
    """Runs training processes for one rank until the run ends or the failure
    budget is spent.

    Rank 0's callbacks run in order on one thread of the agent (a single-worker
    executor), so the training process never waits for tracking; a stop request
    reaches the training process with the reply to a later hook (at most a log
    interval later). `Done` drains them: the record is complete before the run
    returns.
    """

    def __init__(
        self,
        job: TrainJob,
        rank: int,
        world_size: int,
        local_rank: int,
        device: str,
        loader: Any,
        callbacks: Callback | None,
        *,
        rendezvous: Rendezvous,
        target: Callable[[ChildArgs, Any], None] | None = None,
        mp_context: Any = None,
    ):
        self.job, self.rank, self.world = job, rank, world_size
        self.local_rank, self.device = local_rank, device
        self.loader, self.callbacks = loader, callbacks
        self.rendezvous = rendezvous
        if target is None:
            from trainlab.train.supervision.child import main as target
        self.target = target
        self.ctx = mp_context or start_fork_server(job.cfg.train.deterministic)
        self.records = RunRecords(job.run_dir)
        self.feeder: Feeder | None = None
        self._summary: dict[str, Any] | None = None
        self._hooks = (
            ThreadPoolExecutor(1, thread_name_prefix="trainlab-callbacks")
            if callbacks is not None
            else None
        )
        self._last_hook: Future | None = None
        self._stop = StopRequest()
        self._orphaned: str | None = None  # why this group must stop (its driver is gone)

    def failed_flag(self, group: str, attempt: int) -> FailedFlag:
        """Set once any rank's training process of this attempt failed."""
        return FailedFlag(self.records, f"{group}-{attempt}")

    # ------------------------------------------------------------- the loop

    def run(self) -> dict[str, Any] | None:
        """Attempts until one completes (rank 0 returns the summary of `on_run_end`)
        or the failure budget is spent (rank 0 returns the failed summary)."""
        try:
            return self._run()
        finally:
            if self._hooks is not None:
                self._hooks.shutdown(wait=False)  # its thread ends once idle

    def _run(self) -> dict[str, Any] | None:
        group = None
        attempt = 0
        while True:
            t0 = time.time()
            addr, port, group = self.rendezvous.rendezvous(attempt, group)
            started = time.time()
            log.info("attempt %d: rendezvous %s:%d in %.2f s", attempt, addr, port, started - t0)
            args = ChildArgs(
                self.job, self.rank, self.world, self.local_rank, self.device, addr, port
            )
            flag = self.failed_flag(group, attempt)
            summary = self._attempt(args, flag, f"{group}-{attempt}", started)
            if self._orphaned is not None:  # no barrier: the other agents see it alike
                return None
            self.rendezvous.barrier()  # every agent's training process has ended
            if not flag.exists():
                return summary
            faults = [
                f for f in self.records.failures(self.job.session) if f.get("kind") == STORAGE
            ]
            if faults:  # the same write would fail again: never restarted in place
                return self._end_on_fault(str(faults[-1].get("error")))
            bugs = [
                f for f in self.records.failures(self.job.session) if f.get("kind") == COMPONENT
            ]
            if bugs:  # the same code would fail again at the same step
                return self._end_on_bug(str(bugs[-1].get("error")))
            spent = len(self.records.failure_events(self.job.session))
            budget = self.job.cfg.train.max_failures
            if spent > budget:
                return self._give_up(spent, budget)
            self._log_restart(f"{group}-{attempt}", spent, budget)
            attempt += 1

    def _log_restart(self, event: str, spent: int, budget: int) -> None:
        """Why the training processes restart; a chaos kill is the rehearsal working
        as planned (train.chaos.kill_at_steps, `train --smoke`), not an accident."""
        kinds = {
            f.get("kind"): f
            for f in self.records.failures(self.job.session)
            if f.get("event") == event
        }
        if "chaos" in kinds and set(kinds) <= {"chaos", "peer"}:
            log.info(
                "restarting the training processes after the deliberate kill at step %s "
                "(train.chaos.kill_at_steps, as planned; counts as failure %d of at most %d)",
                kinds["chaos"].get("step"),
                spent,
                budget,
            )
            return
        log.warning("restarting the training processes (failure %d of at most %d)", spent, budget)

    def _attempt(
        self, args: ChildArgs, failed_flag: FailedFlag, event: str, started: float
    ) -> dict[str, Any] | None:
        """One training process, served until it exits (or until another rank's
        failed: then it is killed). Returns the run summary, or None after a failure
        (recorded, and `failed_flag` set)."""
        self._summary = None
        next_check = time.monotonic() + orphan_check_s()
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=self.target, args=(args, child), daemon=False, name=f"trainlab-rank{self.rank}"
        )
        proc.start()
        child.close()
        done = reported = False
        try:
            while True:
                if parent.poll(POLL_S):
                    try:
                        request = parent.recv()
                    except (EOFError, OSError):
                        request = None
                    if request is not None:
                        outcome = self._serve(parent, request, event)
                        done = done or outcome == "done"
                        reported = reported or outcome == "failed"
                        continue
                if not proc.is_alive():
                    break
                if failed_flag.exists():  # another rank's training process failed
                    proc.kill()  # SIGKILL; a no-op when it has just ended by itself
                    break
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + orphan_check_s()
                    if self._stop_if_orphaned(proc):
                        break
            proc.join()
        finally:
            parent.close()
            if self.feeder is not None:
                self.feeder.stop()
                self.feeder = None
        if self._orphaned is None and (proc.exitcode != 0 or not done):
            self._stop_if_orphaned(proc)  # a commit refused for it (checkpoint.Orphaned), a kill
        if self._orphaned is not None:
            return None  # nothing recorded: the run is another driver's, or its own is gone
        if proc.exitcode != 0 or not done:
            if not reported:
                self._record_death(proc.exitcode, event, started, failed_flag)
            failed_flag.touch()
            return None
        return self._summary

    def _stop_if_orphaned(self, proc: Any) -> bool:
        """Whether this group's driver is gone (or another holds the run: TrainJob.
        orphaned); then the training process is killed before it commits anything
        more, and this agent ends without a restart or a record."""
        reason = self.job.orphaned()
        if reason is None:
            return False
        log.error(
            "rank %d: %s: stopping this worker group without committing anything more",
            self.rank,
            reason,
        )
        self._orphaned = reason
        proc.kill()
        return True

    def _record_death(
        self, exitcode: int | None, event: str, started: float, failed_flag: FailedFlag
    ) -> None:
        """A training process that died without reporting: a chaos kill, a signal, a
        kill after another rank failed (peer), or a non-zero exit."""
        chaos = self.records.chaos_kill(self.rank, started)
        if chaos is not None:
            self._record(event, chaos["step"], chaos["error"], "chaos")
            return
        if exitcode is not None and exitcode < 0:
            name = signal.Signals(-exitcode).name
            error, kind = f"training process killed by signal {-exitcode} ({name})", "killed"
        else:
            error, kind = f"training process exited with code {exitcode}", "error"
        if exitcode == -signal.SIGKILL and failed_flag.exists():
            error, kind = "stopped after another rank failed", "peer"
        # No step from a process that died without a word: the newest step rank 0
        # logged (the death came after it, within one log interval).
        step = self.records.last_logged_step()
        if step is not None:
            error = f"{error} (after step {step})"
        self._record(event, step, error, kind)

    def _record(self, event: str, step: int | None, error: str, kind: str) -> None:
        self.records.add_failures(Failure(self.job.session, event, self.rank, step, error, kind))

    # ------------------------------------------------------------- requests

    def _serve(self, conn: Any, request: Request, event: str) -> str | None:
        """Answer one request; returns "done" or "failed" for those two."""
        outcome = None
        try:
            value, outcome = self._handle(request, event)
            reply = Reply(value)
        except Exception as e:  # noqa: BLE001 - the training process raises it
            reply = Reply.failed(e)
        try:
            conn.send(reply)
        except (BrokenPipeError, EOFError, OSError):
            pass  # the training process is gone; its exit code tells the rest
        except Exception as e:  # noqa: BLE001 - e.g. a value that does not pickle
            with contextlib.suppress(BrokenPipeError, EOFError, OSError):
                conn.send(Reply(error=f"{type(e).__name__}: {e}"))
        return outcome

    def _handle(self, request: Request, event: str) -> tuple[Any, str | None]:
        match request:
            case NextStep():
                if self.feeder is None:
                    raise RuntimeError("NextStep before IterFrom")
                return self.feeder.next(), None
            case IterFrom(step):
                if self.feeder is not None:
                    self.feeder.stop()
                self.feeder = Feeder(self.loader, step)
                return None, None
            case LoaderCall(method, args):
                return getattr(self.loader, method)(*args), None
            case Hook(name, args):
                if name == "on_run_end":
                    self._summary = args[0]
                elif name == "on_step_end":
                    self.records.write_progress(args[0])  # for failures that take us down
                self._submit_hook(name, args)
                if self.rank == 0 and self.records.interrupt_requested():  # the driver's Ctrl-C
                    return StopRequest(True, INTERRUPT_REASON), None
                return self._stop, None
            case Failed(step, message):
                kind = error_kind(message)
                if kind == STORAGE and self._recorded_fault():
                    return None, "failed"  # its trainer recorded it, with the cause
                error = f"rank {self.rank} failed at step {step}: {message}"
                if kind == STORAGE:  # the cause, as its trainer would have recorded it
                    error = message[len(STORAGE_FAULT) :]
                elif kind == COMPONENT:  # names the component, its hook and the step
                    error = message[len(COMPONENT_ERROR) :]
                self._record(event, step, error, kind)
                return None, "failed"
            case Done():
                self._drain_hooks()  # the record is complete before the run returns
                return None, "done"
        raise RuntimeError(f"unknown request {request!r}")

    # ------------------------------------------------------------- rank 0's callbacks

    def _submit_hook(self, name: str, args: tuple[Any, ...]) -> None:
        if self._hooks is not None:
            self._last_hook = self._hooks.submit(self._run_hook, name, args)

    def _run_hook(self, name: str, args: tuple[Any, ...]) -> None:
        try:
            getattr(self.callbacks, name)(*args)
            self._stop = StopRequest(
                bool(self.callbacks.stop_requested), self.callbacks.stop_reason or ""
            )
        except Exception:  # noqa: BLE001 - tracking must not end training
            log.exception("callback hook %s failed", name)

    def _drain_hooks(self) -> None:
        """Wait for every hook submitted so far (one worker: the last one ends last)."""
        if self._last_hook is not None:
            wait([self._last_hook])

    def _recorded_fault(self) -> bool:
        """This rank's storage fault of this session is in logs/failures.jsonl."""
        return any(
            f.get("kind") == STORAGE and f.get("rank") == self.rank
            for f in self.records.failures(self.job.session)
        )

    def _end_on_fault(self, error: str) -> dict[str, Any] | None:
        """A rank's write to the run's disk failed: the run ends as failed with that
        cause (exit 74), without a restart. Rank 0 returns the summary its trainer
        wrote and sent to the callbacks, or (when the fault was another rank's, or
        its trainer could not) removes partial checkpoints and writes it here."""
        if self.rank != 0:
            return None
        summary = self._summary
        if summary is not None and summary.get("status") == "failed":
            self._drain_hooks()
            return summary
        ckpts.clean_staging(self.job.checkpoint_root)
        self.records.release_room()
        summary = failed_summary(self.job, error)
        try:
            self.records.write_summary(summary)
        except OSError as e:
            log.error("could not write run_summary.json: %s", e)
        self._submit_hook("on_run_end", (summary,))
        self._drain_hooks()
        return summary

    def _end_on_bug(self, error: str) -> dict[str, Any] | None:
        """A user's component raised a programming error: rank 0 writes the failed
        run summary with it (failure_cause "code", exit 1) and closes the record."""
        if self.rank != 0:
            return None
        ckpts.clean_staging(self.job.checkpoint_root)
        summary = failed_summary(self.job, f"{error} (not restarted: fix the component)")
        self.records.write_summary(summary)
        self._submit_hook("on_run_end", (summary,))
        self._drain_hooks()
        return summary

    def _give_up(self, spent: int, budget: int) -> dict[str, Any] | None:
        """Out of failures: rank 0 writes the failed run summary and closes the record."""
        if self.rank != 0:
            return None
        summary = failed_summary(
            self.job, f"gave up after {spent} failure(s) (train.max_failures = {budget})"
        )
        self.records.write_summary(summary)
        self._submit_hook("on_run_end", (summary,))
        self._drain_hooks()
        return summary
