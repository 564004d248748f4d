"""One writer per run directory (trainlab.run.lock): a second process is
refused while the first lives, whoever it is; a lock whose holder died is taken
over and the takeover recorded. The holders are real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainlab.run import lock as run_lock
from trainlab.run.lock import RunLock, RunLockHeld

HOLD = (
    "import sys, time\n"
    "from trainlab.run.lock import RunLock\n"
    "lock = RunLock.acquire(sys.argv[1])\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def hold(run_dir: Path) -> subprocess.Popen:
    """A live process holding run_dir's lock (as a training driver would)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def holder(tmp_path):
    run_dir = tmp_path / "runs" / "2026-01-01" / "tiny"
    proc = hold(run_dir)
    yield run_dir, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_a_second_process_is_refused_naming_the_holder(holder):
    run_dir, proc = holder
    with pytest.raises(RunLockHeld) as e:
        RunLock.acquire(run_dir)
    (line,) = e.value.lines
    assert e.value.exit_code == 2
    assert f"pid {proc.pid} on host {socket.gethostname()} since 20" in line
    assert line.startswith(f"{run_dir}: in use by another trainlab process")
    assert run_lock.live_holder(run_dir) == e.value.holder.describe()


def test_the_lock_of_a_dead_holder_is_taken_over_and_recorded(holder):
    run_dir, proc = holder
    proc.send_signal(signal.SIGKILL)  # no release: the holder record stays behind
    proc.wait(timeout=10)
    assert run_lock.read_holder(run_dir).pid == proc.pid
    assert run_lock.live_holder(run_dir) is None
    with RunLock.acquire(run_dir) as lock:
        assert lock.holder.pid == os.getpid() and run_lock.read_holder(run_dir).pid == os.getpid()
        (record,) = [json.loads(ln) for ln in (run_dir / run_lock.TAKEOVERS).read_text().splitlines()]
        assert record["pid"] == os.getpid() and record["took_over_from"]["pid"] == proc.pid
    # released: nobody holds it, and the next one takes it without a takeover
    assert run_lock.read_holder(run_dir) is None and run_lock.live_holder(run_dir) is None
    with RunLock.acquire(run_dir):
        pass
    assert len((run_dir / run_lock.TAKEOVERS).read_text().splitlines()) == 1


def test_the_same_process_cannot_take_it_twice(tmp_path):
    with (
        RunLock.acquire(tmp_path / "run"),
        pytest.raises(RunLockHeld, match=f"pid {os.getpid()} "),
    ):
        RunLock.acquire(tmp_path / "run")


def _remote(run_dir: Path, beat_age_s: float) -> None:
    """The holder record of a driver on another host (whose flock this host does
    not see, as on some shared filesystems)."""
    run_dir.mkdir(parents=True)
    now = time.time()
    record = {"host": "elsewhere", "pid": 4242, "since": now - 3600, "beat": now - beat_age_s}
    (run_dir / run_lock.HOLDER).write_text(json.dumps(record))


def test_a_fresh_holder_on_another_host_is_live(tmp_path):
    run_dir = tmp_path / "run"
    _remote(run_dir, beat_age_s=5)
    assert run_lock.live_holder(run_dir).startswith("pid 4242 on host elsewhere since ")
    with pytest.raises(RunLockHeld, match="pid 4242 on host elsewhere"):
        RunLock.acquire(run_dir)


def test_a_silent_holder_on_another_host_is_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINLAB_LOST_AFTER_S", "60")
    run_dir = tmp_path / "run"
    _remote(run_dir, beat_age_s=61)
    assert run_lock.live_holder(run_dir) is None
    with RunLock.acquire(run_dir):
        pass
    record = json.loads((run_dir / run_lock.TAKEOVERS).read_text())
    assert record["took_over_from"]["host"] == "elsewhere"


def test_the_holder_beats_while_it_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINLAB_HEARTBEAT_S", "0.1")
    with RunLock.acquire(tmp_path / "run") as lock:
        first = run_lock.read_holder(tmp_path / "run").beat
        time.sleep(0.5)
        assert run_lock.read_holder(tmp_path / "run").beat > first
        assert lock.holder.since == run_lock.read_holder(tmp_path / "run").since
