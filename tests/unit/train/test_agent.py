"""The agent's restart protocol without Ray: a real `Agent` with a fake data
stream, the single-process rendezvous and small training processes (module-level
functions below, forked from the fork server with this module preloaded) that
speak trainlab.train.supervision.protocol: a clean run, a process that dies, one that hangs
while another rank failed, one that reports its failure, and the real
`trainlab.train.supervision.child.main` around a fake Trainer."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainlab.config import ExperimentConfig
from trainlab.run.records import Failure, RunRecords
from trainlab.train.job import TrainJob
from trainlab.train.loop.callbacks import Callback, RunContext
from trainlab.train.supervision.agent import Agent, LocalRendezvous, error_kind
from trainlab.train.supervision.protocol import (
    ChildArgs,
    Done,
    Failed,
    PipeCallbacks,
    PipeClient,
    PipeLoader,
)

pytestmark = pytest.mark.timeout(60)

STEPS = 6
STEP_S = 0.005
GROUP = "g"


# --------------------------------------------------------------------------- fakes


def make_job(tmp_path: Path, max_failures: int = 1, **train: Any) -> TrainJob:
    cfg = ExperimentConfig.model_validate(
        {"name": "agent-test", "train": {"max_failures": max_failures, **train}}
    )
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    return TrainJob(
        cfg=cfg,
        plan={},
        run_dir=str(run_dir),
        config_hash="c0ffee",
        dataset_fingerprint="f00d",
        manifest_path=str(tmp_path / "manifest.json"),
        data_spec=None,
        sources=("code", "docs"),
        session="s1",
        started_at=time.time(),
    )


def batch(step: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.full((2, 4), step, dtype=np.int32)}


class FakeLoader:
    """A stream of `steps` steps of one tiny micro-batch each (numpy, like the real one)."""

    def __init__(self, steps: int = STEPS, fail_at: int | None = None):
        self.steps, self.fail_at = steps, fail_at
        self.pulled = 0  # steps handed out by iter_from's iterators
        self.loaded: list[dict] = []

    def iter_from(self, step: int):
        for s in range(step, self.steps):
            if s == self.fail_at:
                raise OSError(f"shard unreadable at step {s}")
            self.pulled += 1
            yield s, [batch(s)]

    def validation_batches(self, source: str, n: int) -> list[dict]:
        if source not in ("code", "docs"):
            raise KeyError(source)
        return [batch(-1)] * n

    def delivered_shares(self, step: int) -> dict[str, float]:
        return {"code": 0.7, "docs": 0.3}

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        return {"step": step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(state)


class Recorder(Callback):
    """Rank 0's callbacks, in the agent; asks to stop after step `stop_at`."""

    def __init__(self, stop_at: int | None = None):
        self.events: list[tuple] = []
        self.stop_at = stop_at

    def on_run_start(self, ctx: RunContext) -> None:
        self.events.append(("start", ctx.restarts))

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.events.append(("step", step))
        if self.stop_at is not None and step >= self.stop_at:
            self.stop_requested, self.stop_reason = True, "test asked"

    def on_run_end(self, summary: dict[str, Any]) -> None:
        self.events.append(("end", summary["status"]))


# --------------------------------------------------------------------------- training processes


def _started(job: TrainJob) -> int:
    """This run's training processes so far (0 for the first)."""
    path = job.logs_dir / "children.txt"
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    return len(path.read_text().splitlines()) - 1


def _fit(args: ChildArgs, conn: Any, on_step: Any = None) -> None:
    """What a Trainer does over the protocol, in brief: steps until the end of the
    stream (or a stop request), the hooks on rank 0, Done, exit 0."""
    job = args.job
    attempt = _started(job)
    client = PipeClient(conn)
    loader = PipeLoader(client)
    callbacks = PipeCallbacks(client) if args.rank == 0 else None
    if callbacks is not None:
        callbacks.on_run_start(
            RunContext(
                cfg=job.cfg,
                plan=job.plan,
                run_dir=job.run_dir,
                config_hash=job.config_hash,
                dataset_fingerprint=job.dataset_fingerprint,
                manifest_path=job.manifest_path,
                start_step=0,
                restarts=attempt,
            )
        )
    step, status = 0, "completed"
    for got, micro_batches in loader.iter_from(0):
        if got != step or int(micro_batches[0]["input_ids"][0, 0]) != step:
            raise RuntimeError(f"stream gave step {got}, expected {step}")
        step += 1
        if callbacks is not None:
            callbacks.on_step_end(step, {"loss": 1.0 / step})
        if on_step is not None:
            on_step(args, client, attempt, step)
        if callbacks is not None and callbacks.stop_requested:
            status = "stopped"
            break
        time.sleep(STEP_S)
    if callbacks is not None:
        reason = callbacks.stop_reason or None
        callbacks.on_run_end(
            {"status": status, "final_step": step, "attempt": attempt, "stop_reason": reason}
        )
    client.call(Done())
    os._exit(0)


def child_clean(args: ChildArgs, conn: Any) -> None:
    _fit(args, conn)


def _kill_at_2(args: ChildArgs, client: PipeClient, attempt: int, step: int) -> None:
    if attempt == 0 and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)


def child_killed_once(args: ChildArgs, conn: Any) -> None:
    _fit(args, conn, _kill_at_2)


def _exit_at_2(args: ChildArgs, client: PipeClient, attempt: int, step: int) -> None:
    if attempt == 0 and step == 2:
        os._exit(3)


def child_exits_once(args: ChildArgs, conn: Any) -> None:
    _fit(args, conn, _exit_at_2)


def _hang_at_2(args: ChildArgs, client: PipeClient, attempt: int, step: int) -> None:
    if attempt == 0 and step == 2:
        (args.job.logs_dir / "hanging").touch()
        time.sleep(3600)


def child_hangs_once(args: ChildArgs, conn: Any) -> None:
    _fit(args, conn, _hang_at_2)


def _report_at_3(args: ChildArgs, client: PipeClient, attempt: int, step: int) -> None:
    if attempt == 0 and step == 3:
        client.call(Failed(step, "ValueError: loss is nan"))
        os._exit(1)


def child_reports_once(args: ChildArgs, conn: Any) -> None:
    _fit(args, conn, _report_at_3)


DISK_FULL = "no space left on device while saving step 3; newest valid checkpoint step 2"


def _disk_full_at_3(args: ChildArgs, client: PipeClient, attempt: int, step: int) -> None:
    """A trainer whose disk filled (it could record nothing): only Failed says so."""
    if step == 3:
        client.call(Failed(step, f"StorageFault: {DISK_FULL}"))
        os._exit(1)


def child_disk_full(args: ChildArgs, conn: Any) -> None:
    _fit(args, conn, _disk_full_at_3)


def _disk_full_recorded_at_3(args: ChildArgs, client: PipeClient, attempt: int, step: int) -> None:
    """What trainlab.train.loop.trainer does on a storage fault: its failure line, the
    failed summary to the callbacks, then the fault raised (Failed)."""
    if step == 3:
        job = args.job
        failure = Failure(job.session, "storage-s1", args.rank, step, DISK_FULL, "storage")
        RunRecords(job.run_dir).add_failures(failure)
        PipeCallbacks(client).on_run_end({"status": "failed", "error": DISK_FULL, "by": "trainer"})
        client.call(Failed(step, f"StorageFault: {DISK_FULL}"))
        os._exit(1)


def child_disk_full_recorded(args: ChildArgs, conn: Any) -> None:
    _fit(args, conn, _disk_full_recorded_at_3)


BUG = (
    "train.components 'team.probes:make': Probe.after_step at step 3 raised "
    "TypeError: unsupported operand type(s) for +: 'int' and 'str'"
)


def _bug_at_3(args: ChildArgs, client: PipeClient, attempt: int, step: int) -> None:
    """What the training process reports when a user's component has a bug
    (trainlab.train.loop.components.ComponentError)."""
    if step == 3:
        client.call(Failed(step, f"ComponentError: {BUG}"))
        os._exit(1)


def child_component_bug(args: ChildArgs, conn: Any) -> None:
    _fit(args, conn, _bug_at_3)


def _slow(args: ChildArgs, client: PipeClient, attempt: int, step: int) -> None:
    time.sleep(0.3)


def child_slow(args: ChildArgs, conn: Any) -> None:
    _fit(args, conn, _slow)


class FakeTrainer:
    """trainlab.train.loop.trainer.Trainer's surface: (job, loader, env, callbacks), .fit(),
    .step; fails at the step in logs/fail_at when that file exists."""

    def __init__(self, job: TrainJob, loader: Any, env: Any, callbacks: Any):
        self.job, self.loader, self.env, self.callbacks = job, loader, env, callbacks
        self.step = 0

    def fit(self) -> None:
        fail_at = self.job.logs_dir / "fail_at"
        fail = int(fail_at.read_text()) if fail_at.exists() else None
        for _, _batches in self.loader.iter_from(0):
            self.step += 1
            if self.callbacks is not None:
                self.callbacks.on_step_end(self.step, {"loss": 1.0})
            if self.step == fail:
                raise ValueError(f"loss is nan at step {self.step}\nmore detail")
        if self.callbacks is not None:
            self.callbacks.on_run_end({"status": "completed", "final_step": self.step})


def child_main_fake_trainer(args: ChildArgs, conn: Any) -> None:
    """The real child entry point, with FakeTrainer as trainlab.train.loop.trainer.Trainer."""
    from trainlab.train.supervision import child

    sys.modules["trainlab.train.loop.trainer"] = types.SimpleNamespace(Trainer=FakeTrainer)  # type: ignore[assignment]
    child.main(args, conn)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def mp_context():
    """The fork server, with this module (the training processes) and torch
    (child.main imports it) imported once."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "trainlab.train.supervision.child", __name__])
    return ctx


def make_agent(job, mp_context, target, callbacks=None, loader=None) -> Agent:
    return Agent(
        job,
        0,
        1,
        0,
        "cpu",
        loader or FakeLoader(),
        callbacks,
        rendezvous=LocalRendezvous(group=GROUP),
        target=target,
        mp_context=mp_context,
    )


def failures(job: TrainJob) -> list[dict[str, Any]]:
    return RunRecords(job.run_dir).failures(job.session)


def children(job: TrainJob) -> int:
    path = job.logs_dir / "children.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


# --------------------------------------------------------------------------- tests


def test_clean_run_returns_the_summary_of_on_run_end(tmp_path, mp_context):
    job = make_job(tmp_path)
    recorder = Recorder()
    summary = make_agent(job, mp_context, child_clean, recorder).run()
    assert summary == {
        "status": "completed",
        "final_step": STEPS,
        "attempt": 0,
        "stop_reason": None,
    }
    # Every hook ran, in order, before the run returned (Done drains them).
    assert recorder.events == [
        ("start", 0),
        *[("step", s) for s in range(1, STEPS + 1)],
        ("end", "completed"),
    ]
    assert failures(job) == []
    assert children(job) == 1
    assert RunRecords(job.run_dir).last_logged_step() == STEPS
    assert not list(job.logs_dir.glob(".failed-*"))


def test_a_stop_request_reaches_the_training_process(tmp_path, mp_context):
    job = make_job(tmp_path)
    recorder = Recorder(stop_at=2)
    summary = make_agent(job, mp_context, child_clean, recorder, FakeLoader(steps=200)).run()
    assert summary["status"] == "stopped" and summary["stop_reason"] == "test asked"
    # Hooks run off the agent's main thread: the stop comes with a later reply.
    assert 2 <= summary["final_step"] < 200
    assert recorder.events[-1] == ("end", "stopped")


@pytest.mark.parametrize(
    ("target", "kind", "error"),
    [
        (child_killed_once, "killed", "training process killed by signal 9 (SIGKILL)"),
        (child_exits_once, "error", "training process exited with code 3"),
    ],
)
def test_a_dead_training_process_is_recorded_and_restarted(
    tmp_path, mp_context, target, kind, error
):
    job = make_job(tmp_path, max_failures=1)
    recorder = Recorder()
    summary = make_agent(job, mp_context, target, recorder).run()
    assert summary is not None and summary["status"] == "completed"
    assert summary["attempt"] == 1 and children(job) == 2
    [failure] = failures(job)
    assert failure["kind"] == kind and failure["rank"] == 0
    # No word from the process: the step is the newest one rank 0 logged.
    assert failure["step"] == 2
    assert failure["error"] == f"{error} (after step 2)"
    assert failure["event"] == f"{GROUP}-0"
    assert set(failure) == {"session", "event", "time", "rank", "step", "error", "kind"}
    assert (job.logs_dir / f".failed-{GROUP}-0").exists()
    # The callbacks survived the restart: both attempts' hooks, in order.
    assert recorder.events[:3] == [("start", 0), ("step", 1), ("step", 2)]
    assert ("start", 1) in recorder.events and recorder.events[-1] == ("end", "completed")


def test_out_of_failures_the_agent_gives_up_with_a_failed_summary(tmp_path, mp_context):
    job = make_job(tmp_path, max_failures=0)
    recorder = Recorder()
    summary = make_agent(job, mp_context, child_killed_once, recorder).run()
    assert children(job) == 1
    assert summary["status"] == "failed"
    assert summary["error"] == "gave up after 1 failure(s) (train.max_failures = 0)"
    assert summary["failure_cause"] == "infrastructure"
    assert [f["kind"] for f in summary["failures"]] == ["killed"]
    on_disk = json.loads((job.run_path / "run_summary.json").read_text())
    assert on_disk["status"] == "failed" and on_disk["error"] == summary["error"]
    assert recorder.events[-1] == ("end", "failed")  # the record is closed


def test_a_hanging_process_is_killed_when_another_rank_failed(tmp_path, mp_context):
    job = make_job(tmp_path, max_failures=1)
    agent = make_agent(job, mp_context, child_hangs_once, Recorder())
    flagged: list[float] = []

    def other_rank_fails() -> None:
        deadline = time.time() + 30
        while not (job.logs_dir / "hanging").exists() and time.time() < deadline:
            time.sleep(0.01)
        flagged.append(time.time())
        agent.failed_flag(GROUP, 0).touch()

    peer = threading.Thread(target=other_rank_fails, daemon=True)
    peer.start()
    summary = agent.run()
    peer.join()
    assert summary is not None and summary["attempt"] == 1
    [failure] = failures(job)
    assert failure["kind"] == "peer" and failure["step"] == 2
    assert failure["error"] == "stopped after another rank failed (after step 2)"
    assert failure["time"] - flagged[0] < 2.0  # killed promptly, not at a timeout


def test_a_reported_failure_is_recorded_with_its_step_and_message(tmp_path, mp_context):
    job = make_job(tmp_path, max_failures=1)
    summary = make_agent(job, mp_context, child_reports_once, Recorder()).run()
    assert summary is not None and summary["attempt"] == 1
    [failure] = failures(job)  # reported: no second record for the exit code
    assert failure["step"] == 3 and failure["kind"] == "error"
    assert failure["error"] == "rank 0 failed at step 3: ValueError: loss is nan"


def test_a_storage_fault_ends_the_run_without_a_restart(tmp_path, mp_context):
    job = make_job(tmp_path, max_failures=3)
    partial = job.checkpoint_root / ".tmp-step-00000003"
    partial.mkdir(parents=True)
    recorder = Recorder()
    summary = make_agent(job, mp_context, child_disk_full, recorder).run()
    assert children(job) == 1  # the same write would fail again: no restart in place
    assert summary["status"] == "failed" and summary["error"] == DISK_FULL
    assert summary["failure_cause"] == "storage"
    [failure] = failures(job)
    assert failure["kind"] == "storage" and failure["step"] == 3
    assert failure["error"] == DISK_FULL
    assert not partial.exists()
    on_disk = json.loads((job.run_path / "run_summary.json").read_text())
    assert on_disk["error"] == DISK_FULL
    assert recorder.events[-1] == ("end", "failed")  # the record is closed


def test_a_storage_fault_its_trainer_recorded_is_not_recorded_twice(tmp_path, mp_context):
    job = make_job(tmp_path, max_failures=3)
    recorder = Recorder()
    summary = make_agent(job, mp_context, child_disk_full_recorded, recorder).run()
    assert children(job) == 1
    assert summary == {"status": "failed", "error": DISK_FULL, "by": "trainer"}
    [failure] = failures(job)
    assert failure["kind"] == "storage" and failure["error"] == DISK_FULL
    assert [e for e in recorder.events if e[0] == "end"] == [("end", "failed")]


def test_a_components_bug_ends_the_run_without_a_restart(tmp_path, mp_context):
    """A programming error in a user's component hook fails the same way at the same
    step after a restart: the run ends at once, failure_cause "code" (exit 1)."""
    job = make_job(tmp_path, max_failures=3)
    recorder = Recorder()
    summary = make_agent(job, mp_context, child_component_bug, recorder).run()
    assert children(job) == 1
    assert summary["status"] == "failed"
    assert summary["error"] == f"{BUG} (not restarted: fix the component)"
    assert summary["failure_cause"] == "code"
    [failure] = failures(job)
    assert failure["kind"] == "component" and failure["step"] == 3 and failure["error"] == BUG
    assert recorder.events[-1] == ("end", "failed")


def test_a_group_whose_driver_is_gone_stops_without_a_record(tmp_path, mp_context, monkeypatch):
    """Issue 38 item 9: the driver was SIGKILLed (its lock record names a process
    that is gone): each agent sees it within TRAINLAB_ORPHAN_CHECK_S, kills its
    training process before it commits anything more, and ends: no restart, no
    failure, no summary (the next driver's resume writes those)."""
    import dataclasses
    import socket
    import subprocess

    monkeypatch.setenv("TRAINLAB_ORPHAN_CHECK_S", "0.1")
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)  # fmt: skip
    driver = (socket.gethostname(), dead, 1.0)
    job = dataclasses.replace(make_job(tmp_path, max_failures=3), driver=driver)
    record = {"host": driver[0], "pid": dead, "since": 1.0, "beat": time.time()}
    (job.run_path / ".lock.json").write_text(json.dumps(record))
    recorder = Recorder()
    t0 = time.monotonic()
    assert make_agent(job, mp_context, child_slow, recorder).run() is None
    assert time.monotonic() - t0 < 1.5  # 6 steps of 0.3 s would take 1.8 s
    assert children(job) == 1 and failures(job) == []
    assert not (job.run_path / "run_summary.json").exists()
    assert ("end", "completed") not in recorder.events


def test_orphaned_tells_a_live_driver_from_a_gone_or_replaced_one(tmp_path):
    import socket
    import subprocess

    from trainlab.run.holder import current_holder, orphaned
    from trainlab.run.location import RunLocation
    from trainlab.run.lock import RunLock

    loc = RunLocation.of(tmp_path / "run")
    with RunLock.acquire(loc):
        me = current_holder(loc)
        driver = (me.host, me.pid, me.since)
        assert orphaned(loc, driver) is None  # this process: alive, holding it
        assert "another driver holds the run" in orphaned(loc, (me.host, me.pid, 2.0))
    assert orphaned(loc, driver) is None  # released after its workers ended: nothing to say
    gone = {"host": socket.gethostname(), "pid": 2**22 + 7, "since": 3.0, "beat": 3.0}
    (tmp_path / "run" / ".lock.json").write_text(json.dumps(gone))
    assert orphaned(loc, (gone["host"], gone["pid"], 3.0)) == (
        f"its driver (pid {2**22 + 7} on this host) is gone"
    )
    # a driver killed but not reaped yet (a zombie: its parent was killed too) is gone
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while "Z" not in Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2][:3]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    record = {**gone, "pid": zombie.pid}
    (tmp_path / "run" / ".lock.json").write_text(json.dumps(record))
    assert "is gone" in orphaned(loc, (gone["host"], zombie.pid, 3.0))
    zombie.wait()


def test_an_unreadable_failed_flag_is_no_failure(tmp_path, monkeypatch, caplog):
    """The agents look at the attempt's failed flag every half second; storage that
    does not answer (a store outage) is no news, not an error that ends the agent
    (it once did: its training process died of a broken pipe, the run with it)."""
    import logging

    from trainlab.location import Unavailable
    from trainlab.train.supervision.agent import FailedFlag

    records = RunRecords(tmp_path)
    flag = FailedFlag(records, "g-0")

    def unavailable(*args):
        raise Unavailable("s3://b/run/logs/.failed-g-0: Could not connect to server")

    monkeypatch.setattr(RunRecords, "attempt_failed", unavailable)
    monkeypatch.setattr(RunRecords, "mark_attempt_failed", unavailable)
    with caplog.at_level(logging.WARNING):
        assert flag.exists() is False
        flag.touch()  # setting it fails too: this rank still knows
    assert flag.exists() is True
    assert sum("failed flag" in r.getMessage() for r in caplog.records) == 2


def test_error_kind_tells_a_lost_peer_from_an_error():
    assert error_kind("RuntimeError: Connection reset by peer") == "peer"
    assert error_kind("ValueError: loss is nan") == "error"
    assert error_kind(f"StorageFault: {DISK_FULL}") == "storage"


def test_child_main_completes_and_reports_failures(tmp_path, mp_context):
    job = make_job(tmp_path, max_failures=0)
    recorder = Recorder()
    summary = make_agent(job, mp_context, child_main_fake_trainer, recorder).run()
    assert summary == {"status": "completed", "final_step": STEPS}
    assert failures(job) == []
    assert "training process" in (job.logs_dir / "rank0.log").read_text()

    (job.logs_dir / "fail_at").write_text("4")
    summary = make_agent(job, mp_context, child_main_fake_trainer, recorder).run()
    assert summary["status"] == "failed"
    [failure] = failures(job)
    assert failure["step"] == 4 and failure["kind"] == "error"
    assert failure["error"] == "rank 0 failed at step 4: ValueError: loss is nan at step 4"
    # The error on the line itself (the terminal shows that line; it ended in ":").
    logged = (job.logs_dir / "rank0.log").read_text()
    assert "training process failed at step 4: ValueError: loss is nan at step 4\n" in logged
