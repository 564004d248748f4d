"""Fast restarts: each Ray Train worker supervises a training process.

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

- agent (the Ray Train worker, one per rank): the data stream
  (`trainlab.data.WorkerLoader`, Ray Data included), the callbacks on rank 0
  (MLflow survives restarts), the failure records and the failure budget.
- training process (child): model, optimizer, process group, checkpoints; it
  asks its agent for batches and forwards callback hooks over a pipe
  (`PipeLoader`, `PipeCallbacks`).

An agent that dies (node lost, actor killed) is still handled by Ray Train:
`FailureConfig(max_failures)` restarts the group, which resumes the same way.
Both kinds of failure count against `train.max_failures` (logs/failures.jsonl).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainlab.train.callbacks import Callback, RunContext
from trainlab.train.job import TrainJob
from trainlab.train.summary import last_logged_step

log = logging.getLogger("trainlab.train")

POLL_S = 0.05
PREFETCH_STEPS = 4


# --------------------------------------------------------------------------- failures file

# Collective errors that only say a peer went away: the cause is the peer's failure.
PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Socket Timeout",
    "NCCL communicator was aborted",
)


def error_kind(message: str) -> str:
    """`peer` when a training process failed because another one died, else `error`."""
    return "peer" if any(s in message for s in PEER_LOST) else "error"


def record_failure(
    job: TrainJob, event: str, rank: int, step: int | None, error: str, kind: str
) -> None:
    """Append one failure to logs/failures.jsonl (small O_APPEND writes do not interleave).
    `kind`: one of trainlab.train.summary.FAILURE_KINDS."""
    record = {
        "session": job.session,
        "event": event,
        "time": time.time(),
        "rank": rank,
        "step": step,
        "error": error,
        "kind": kind,
    }
    line = json.dumps(record)
    with open(job.logs_dir / "failures.jsonl", "a") as f:
        f.write(line + "\n")


def failure_events(job: TrainJob) -> set[str]:
    """Distinct failures of this session (one per failed attempt, whatever the ranks)."""
    path = job.logs_dir / "failures.jsonl"
    if not path.exists():
        return set()
    events = set()
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("session") == job.session:
            events.add(rec.get("event") or f"t{rec.get('time')}")
    return events


def chaos_record(job: TrainJob, rank: int, since: float) -> dict[str, Any] | None:
    """The chaos marker a killed training process of `rank` left, if any."""
    for marker in sorted(job.logs_dir.glob("chaos-step-*.json"), reverse=True):
        try:
            rec = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("rank") == rank and rec.get("time", 0) >= since:
            return rec
    return None


# --------------------------------------------------------------------------- child side


class PipeClient:
    def __init__(self, conn: Any):
        self.conn = conn
        self.lock = threading.Lock()

    def call(self, *request: Any) -> Any:
        with self.lock:
            self.conn.send(request)
            status, payload = self.conn.recv()
        if status == "error":
            raise RuntimeError(payload)
        return payload


class PipeLoader:
    """The agent's data stream, seen from the training process."""

    def __init__(self, client: PipeClient):
        self.client = client

    def iter_from(self, step: int):
        """Steps from `step`, fetched by a thread a few steps ahead so that the round
        trip to the agent overlaps the current step's compute."""
        self.client.call("iter_from", step)
        ahead: queue.Queue = queue.Queue(maxsize=PREFETCH_STEPS)

        def fetch() -> None:
            while True:
                try:
                    item = self.client.call("next")
                except BaseException as e:  # noqa: BLE001 - re-raised in the training loop
                    ahead.put(("error", e))
                    return
                ahead.put(("ok", item))
                if item is None:  # the end of the stream
                    return

        threading.Thread(target=fetch, name="trainlab-fetch", daemon=True).start()
        while True:
            status, item = ahead.get()
            if status == "error":
                raise item
            if item is None:
                return
            yield item

    def validation_batches(self, source: str, n: int) -> list[dict]:
        return self.client.call("validation", source, n)

    def delivered_shares(self, step: int) -> dict[str, float]:
        return self.client.call("shares", step)

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        return self.client.call("state", step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.client.call("load_state", state)


class PipeCallbacks(Callback):
    """Rank 0's callbacks, run by the agent; a stop request comes back with each reply."""

    def __init__(self, client: PipeClient):
        self.client = client
        self._stop, self._reason = False, ""

    def _hook(self, name: str, *args: Any) -> None:
        self._stop, self._reason = self.client.call("callback", name, args)

    def on_run_start(self, ctx: RunContext) -> None:
        self._hook("on_run_start", ctx)

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self._hook("on_step_end", step, metrics)

    def on_eval(self, step: int, val_losses: dict[str, float]) -> None:
        self._hook("on_eval", step, val_losses)

    def on_checkpoint(self, step: int, path: str, valid: bool, val_loss: float | None) -> None:
        self._hook("on_checkpoint", step, path, valid, val_loss)

    def on_run_end(self, summary: dict[str, Any]) -> None:
        self._hook("on_run_end", summary)

    @property
    def stop_requested(self) -> bool:  # type: ignore[override]
        return self._stop

    @property
    def stop_reason(self) -> str:  # type: ignore[override]
        return self._reason


@dataclass
class ChildArgs:
    job: dict[str, Any]
    rank: int
    world_size: int
    local_rank: int
    device: str
    master_addr: str
    master_port: int


def normal_priority() -> None:
    """Ray runs its worker processes at nice 15 so its control plane stays responsive;
    training (the agent and its training process) is the node's main work, so it takes
    back the normal priority when allowed. At nice 15 every nice-0 process on the node
    (Ray's log monitor, GCS, a user's shell) preempts it almost entirely."""
    with contextlib.suppress(OSError):  # lowering niceness needs CAP_SYS_NICE
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)


def child_main(args: ChildArgs, conn: Any) -> None:
    """Entry point of a training process (forked from the agent's fork server)."""
    import torch
    import torch.distributed as dist

    from trainlab.train.distributed import DistEnv
    from trainlab.train.loop import Trainer
    from trainlab.train.worker import setup_logging

    t0 = time.time()
    normal_priority()
    job = TrainJob.from_dict(args.job)
    setup_logging(job.logs_dir, args.rank)
    client = PipeClient(conn)
    trainer = None
    try:
        torch.set_num_threads(job.torch_threads)
        device = torch.device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if args.world_size > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend,
                init_method=f"tcp://{args.master_addr}:{args.master_port}",
                rank=args.rank,
                world_size=args.world_size,
            )
        log.info(
            "training process %d up: process group ready %.2f s after fork",
            os.getpid(),
            time.time() - t0,
        )
        env = DistEnv(args.rank, args.world_size, args.local_rank, device)
        callbacks = PipeCallbacks(client) if args.rank == 0 else None
        trainer = Trainer(job, PipeLoader(client), env, callbacks)
        trainer.fit()
        if dist.is_initialized():
            dist.destroy_process_group()
        client.call("done")
    except BaseException as e:  # noqa: BLE001 - reported to the agent, then a non-zero exit
        step = trainer.step if trainer is not None else None
        first = (str(e).strip().splitlines() or [""])[0]
        log.error("training process failed at step %s:\n%s", step, traceback.format_exc())
        with contextlib.suppress(Exception):  # the agent may be gone too
            client.call("failed", step, f"{type(e).__name__}: {first}"[:500])
        for handler in logging.getLogger("trainlab").handlers:
            handler.flush()
        os._exit(1)
    os._exit(0)


# --------------------------------------------------------------------------- agent side


class Feeder:
    """Prefetches the stream's steps in a thread so the training process never waits
    on the agent's data pipeline more than it must."""

    def __init__(self, loader: Any, step: int):
        self.queue: queue.Queue = queue.Queue(maxsize=PREFETCH_STEPS)
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.ended = False
        self.thread = threading.Thread(
            target=self._run, args=(loader, step), daemon=True, name=f"feeder-{step}"
        )
        self.thread.start()

    def _run(self, loader: Any, step: int) -> None:
        try:
            for item in loader.iter_from(step):
                if not self._put(item):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the training process
            self.error = e
        self._put(None)  # the end of the stream (or its failure)

    def _put(self, item: Any) -> bool:
        while not self.stopped.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> Any:
        """The next (step, micro_batches), or None at the end of the stream (again and
        again: the training process may ask ahead)."""
        if self.ended:
            return None
        item = self.queue.get()
        if item is None:
            self.ended = True
            if self.error is not None:
                raise RuntimeError(f"data stream failed: {type(self.error).__name__}: {self.error}")
        return item

    def stop(self) -> None:
        self.stopped.set()


def start_fork_server(deterministic: bool) -> Any:
    """The multiprocessing context whose fork server has torch and the training loop
    imported; started now so that its imports overlap the agent's own setup."""
    import multiprocessing.forkserver

    ctx = mp.get_context("forkserver")
    preload = ["trainlab.train.loop", "trainlab.train.supervisor"]
    if deterministic:
        preload.append("torch._inductor.config")  # torch.use_deterministic_algorithms needs it
    ctx.set_forkserver_preload(preload)
    multiprocessing.forkserver.ensure_running()
    return ctx


class CallbackRunner:
    """Runs rank 0's callbacks in order in a thread of the agent, so the training
    process never waits for tracking. A stop request reaches the training process
    with the reply to a later hook (at most a log interval later)."""

    def __init__(self, callbacks: Any):
        self.callbacks = callbacks
        self.queue: queue.Queue = queue.Queue()
        self.stop: tuple[bool, str] = (False, "")
        threading.Thread(target=self._run, name="trainlab-callbacks", daemon=True).start()

    def submit(self, hook: str, args: tuple) -> None:
        self.queue.put((hook, args))

    def drain(self) -> None:
        self.queue.join()

    def _run(self) -> None:
        while True:
            hook, args = self.queue.get()
            try:
                getattr(self.callbacks, hook)(*args)
                self.stop = (bool(self.callbacks.stop_requested), self.callbacks.stop_reason or "")
            except Exception:  # noqa: BLE001 - tracking must not end training
                log.exception("callback hook %s failed", hook)
            finally:
                self.queue.task_done()


@dataclass
class AttemptResult:
    ok: bool
    summary: dict[str, Any] | None = None


class Agent:
    """Runs training processes for one rank until the run ends or the failure
    budget is spent."""

    def __init__(
        self,
        job: TrainJob,
        rank: int,
        world_size: int,
        local_rank: int,
        device: str,
        loader: Any,
        callbacks: Any,
    ):
        self.job, self.rank, self.world = job, rank, world_size
        self.local_rank, self.device = local_rank, device
        self.loader, self.callbacks = loader, callbacks
        self.feeder: Feeder | None = None
        self._summary: dict[str, Any] | None = None
        self.runner = CallbackRunner(callbacks) if callbacks is not None else None
        self.ctx = start_fork_server(bool(job.cfg["train"]["deterministic"]))

    # ------------------------------------------------------------- collectives

    def _rendezvous(self, attempt: int, group: str | None) -> tuple[str, int, str]:
        """Rank 0 picks the training processes' address and a free port."""
        from ray.train.collective import broadcast_from_rank_zero

        offer = None
        if self.rank == 0:
            import ray.util

            addr = ray.util.get_node_ip_address()
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            offer = (addr, port, group or uuid.uuid4().hex[:8])
        return broadcast_from_rank_zero(offer)

    def _failed_flag(self, group: str, attempt: int) -> Path:
        return self.job.logs_dir / f".failed-{group}-{attempt}"

    # ------------------------------------------------------------- the loop

    def run(self) -> dict[str, Any] | None:
        from ray.train.collective import barrier

        group = None
        attempt = 0
        while True:
            t0 = time.time()
            addr, port, group = self._rendezvous(attempt, group)
            started = time.time()
            log.info("attempt %d: rendezvous %s:%d in %.2f s", attempt, addr, port, started - t0)
            result = self._attempt(
                ChildArgs(
                    self.job.to_dict(),
                    self.rank,
                    self.world,
                    self.local_rank,
                    self.device,
                    addr,
                    port,
                ),
                self._failed_flag(group, attempt),
                f"{group}-{attempt}",
                started,
            )
            barrier()  # every agent's training process has ended
            failed = self._failed_flag(group, attempt).exists()
            if not failed:
                return result.summary
            spent = len(failure_events(self.job))
            budget = ExperimentConfigView(self.job).max_failures
            if spent > budget:
                return self._give_up(spent, budget)
            log.warning(
                "restarting the training processes (failure %d of at most %d)", spent, budget
            )
            attempt += 1

    def _attempt(
        self, args: ChildArgs, failed_flag: Path, event: str, started: float
    ) -> AttemptResult:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=child_main, args=(args, child), daemon=False, name=f"trainlab-rank{self.rank}"
        )
        proc.start()
        child.close()
        result = AttemptResult(ok=False)
        reported = False
        try:
            while True:
                if parent.poll(POLL_S):
                    try:
                        request = parent.recv()
                    except (EOFError, OSError):
                        request = None
                    if request is not None:
                        outcome = self._serve(parent, request, event)
                        if outcome == "done":
                            result.ok = True
                        elif outcome == "failed":
                            reported = True
                        continue
                if not proc.is_alive():
                    break
                if failed_flag.exists():  # another rank's training process failed
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.join()
                    break
            proc.join()
        finally:
            parent.close()
            if self.feeder is not None:
                self.feeder.stop()
                self.feeder = None
        if proc.exitcode != 0 or not result.ok:
            if not reported:
                self._record_death(proc.exitcode, event, started)
            failed_flag.touch()
            return AttemptResult(ok=False)
        return AttemptResult(ok=True, summary=self._summary)

    def _record_death(self, exitcode: int | None, event: str, started: float) -> None:
        chaos = chaos_record(self.job, self.rank, started)
        if chaos is not None:
            record_failure(self.job, event, self.rank, chaos["step"], chaos["error"], "chaos")
            return
        if exitcode is not None and exitcode < 0:
            name = signal.Signals(-exitcode).name
            error, kind = f"training process killed by signal {-exitcode} ({name})", "killed"
        else:
            error, kind = f"training process exited with code {exitcode}", "error"
        if exitcode == -signal.SIGKILL and self._peer_failed_first(event):
            error, kind = "stopped after another rank failed", "peer"
        # No step from a process that died without a word: the newest step rank 0
        # logged (the death came after it, within one log interval).
        step = last_logged_step(self.job.logs_dir)
        if step is not None:
            error = f"{error} (after step {step})"
        record_failure(self.job, event, self.rank, step, error, kind)

    def _peer_failed_first(self, event: str) -> bool:
        group, attempt = event.rsplit("-", 1)
        return self._failed_flag(group, int(attempt)).exists()

    def _serve(self, conn: Any, request: tuple, event: str) -> str | None:
        kind, *args = request
        try:
            if kind == "next":
                conn.send(("ok", self.feeder.next()))
            elif kind == "iter_from":
                if self.feeder is not None:
                    self.feeder.stop()
                self.feeder = Feeder(self.loader, args[0])
                conn.send(("ok", None))
            elif kind == "validation":
                conn.send(("ok", self.loader.validation_batches(*args)))
            elif kind == "shares":
                conn.send(("ok", self.loader.delivered_shares(*args)))
            elif kind == "state":
                conn.send(("ok", self.loader.state_dict(*args)))
            elif kind == "load_state":
                self.loader.load_state_dict(args[0])
                conn.send(("ok", None))
            elif kind == "callback":
                name, hook_args = args
                if name == "on_run_end":
                    self._summary = hook_args[0]
                elif name == "on_step_end":
                    self._write_progress(hook_args[0])
                if self.runner is not None:
                    self.runner.submit(name, hook_args)
                    conn.send(("ok", self.runner.stop))
                else:
                    conn.send(("ok", (False, "")))
            elif kind == "failed":
                step, message = args
                record_failure(
                    self.job,
                    event,
                    self.rank,
                    step,
                    f"rank {self.rank} failed at step {step}: {message}",
                    error_kind(message),
                )
                conn.send(("ok", None))
                return "failed"
            elif kind == "done":
                if self.runner is not None:
                    self.runner.drain()  # the record is complete before the run returns
                conn.send(("ok", None))
                return "done"
            else:
                conn.send(("error", f"unknown request {kind!r}"))
        except (BrokenPipeError, EOFError):
            pass
        except Exception as e:  # noqa: BLE001 - the training process raises it
            with contextlib.suppress(BrokenPipeError, EOFError, OSError):
                conn.send(("error", f"{type(e).__name__}: {e}"))
        return None

    def _write_progress(self, step: int) -> None:
        """Rank 0's newest logged step, for failures that take the agent down too."""
        tmp = self.job.logs_dir / ".progress.json.tmp"
        tmp.write_text(json.dumps({"step": step, "time": time.time()}))
        tmp.replace(self.job.logs_dir / "progress.json")

    def _give_up(self, spent: int, budget: int) -> dict[str, Any] | None:
        """Out of failures: rank 0 writes the failed run summary and closes the record."""
        if self.rank != 0:
            return None
        from trainlab.train.summary import failed_summary, write_summary

        summary = failed_summary(
            self.job, f"gave up after {spent} failure(s) (train.max_failures = {budget})"
        )
        write_summary(self.job.run_path, summary)
        if self.runner is not None:
            self.runner.submit("on_run_end", (summary,))
            self.runner.drain()
        return summary


@dataclass
class ExperimentConfigView:
    """The few config values the agent needs, without validating the config again."""

    job: TrainJob

    @property
    def max_failures(self) -> int:
        return int(self.job.cfg["train"]["max_failures"])
