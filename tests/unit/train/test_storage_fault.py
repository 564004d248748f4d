"""Disk full (or any I/O error) during a checkpoint save or a record write ends the
attempt cleanly (issue 27, "Faults recorded"): the partial checkpoint removed,
the earlier valid checkpoint kept, run_summary.json `failed` with the cause
(`no space left on device while saving step 8; newest valid checkpoint step 4`),
the failure in logs/failures.jsonl, the callbacks' `on_run_end` (MLflow) told the
same, and the agent never restarts it in place.

Two ways to make the disk fail between two saves of a real in-process run
(`Trainer(job, local_loader(job), DistEnv(), callbacks).fit()`):

- a real full disk: the run directory on a small tmpfs (mounted here when this
  process may mount, else that test is skipped), filled by a callback right
  after the first checkpoint, so the second one's DCP write gets ENOSPC from the
  kernel;
- an injected fault at the OS-call level: `trainlab.train.checkpoint.save_file`
  (what writes every rank's RNG file and rank 0's trainer.pt into the staging
  directory) raises OSError(ENOSPC) from the second save on, sync and async; and
  a record write (logs/attempts.jsonl) that raises EIO.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.train_helpers import dataset_dir, local_loader, make_job, tiny_config
from trainlab.run import checkpoints as ckpts
from trainlab.run.records import RESERVE, RunRecords, failure_cause
from trainlab.train import checkpoint as ck
from trainlab.train.loop.callbacks import Callback
from trainlab.train.loop.components import Component
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv

# TINY saves every 4 steps: step 4 is written, step 8 is the one the disk fails.
TRAIN = {"total_steps": 12, "checkpoint": {"every_steps": 4, "keep_last": 2, "keep_best": 1}}
CAUSE = "no space left on device while saving step 8; newest valid checkpoint step 4"


class Ends(Callback):
    """Rank 0's callbacks as MLflow's sees them: the run's end and its summary."""

    def __init__(self) -> None:
        self.summaries: list[dict[str, Any]] = []
        self.checkpoints: list[int] = []

    def on_checkpoint(self, step, path, valid, val_loss):
        self.checkpoints.append(step)

    def on_run_end(self, summary):
        self.summaries.append(summary)


class FillDisk(Ends):
    """After the first checkpoint, fills the run's disk to within `margin` bytes."""

    def __init__(self, run_dir: Path, margin: int = 4096):
        super().__init__()
        self.run_dir, self.margin = run_dir, margin

    def on_checkpoint(self, step, path, valid, val_loss):
        super().on_checkpoint(step, path, valid, val_loss)
        if len(self.checkpoints) == 1:
            st = os.statvfs(self.run_dir)
            free = st.f_bavail * st.f_frsize
            with open(self.run_dir / "filler", "wb") as f:
                f.write(b"\0" * max(0, free - self.margin))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def fit(cfg, run_dir: Path, callbacks: Callback) -> tuple[Trainer, BaseException | None]:
    job = make_job(cfg, run_dir)
    trainer = Trainer(job, local_loader(job), DistEnv(), callbacks)
    try:
        trainer.fit()
    except ck.StorageFault as e:
        return trainer, e
    return trainer, None


def assert_recorded(run_dir: Path, ends: Ends, cause: str, step: int, kept: list[int]) -> None:
    """The fault as every record says it; the partial checkpoint gone, the earlier kept."""
    root = run_dir / "checkpoints"
    assert not [p.name for p in root.iterdir() if p.name.startswith(ckpts.STAGING_PREFIX)]
    assert [i.step for i in ckpts.committed(root)] == kept
    newest = ckpts.find_resume(root)
    assert (newest.step if newest else None) == (kept[-1] if kept else None)
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"] == cause
    assert summary["failure_cause"] == "storage"
    assert summary["final_step"] == (kept[-1] if kept else 0)
    [failure] = RunRecords(run_dir).failures()
    assert failure["kind"] == "storage" and failure["step"] == step
    assert failure["error"] == cause and failure["rank"] == 0
    assert failure_cause([failure]) == "storage"
    # rank 0's callbacks (MLflow journals it: status FAILED, the error tag) got the same
    [ended] = ends.summaries
    assert ended["status"] == "failed" and ended["error"] == cause


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs at tmp_path/disk, or a skip where this process may not mount."""
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is None or done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=10)


def test_a_real_full_disk_between_two_saves_ends_the_run_recorded(dataset, small_disk):
    run_dir = small_disk / "run"
    ends = FillDisk(run_dir)
    trainer, fault = fit(tiny_config(dataset, train=TRAIN), run_dir, ends)
    assert fault is not None and fault.error.errno == errno.ENOSPC
    assert str(fault) == CAUSE
    assert ends.checkpoints == [4]  # step 8 never committed
    assert_recorded(run_dir, ends, CAUSE, step=8, kept=[4])


@pytest.mark.parametrize("async_save", [False, True])
def test_an_injected_enospc_on_the_second_save_ends_the_run_recorded(
    dataset, tmp_path, monkeypatch, async_save
):
    real = ck.save_file

    def save_file(obj: Any, path: Path) -> None:
        if path.parent.name != f"{ckpts.STAGING_PREFIX}{ckpts.dir_name(4)}":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(obj, path)

    monkeypatch.setattr(ck, "save_file", save_file)
    cfg = tiny_config(
        dataset, train={**TRAIN, "checkpoint": {**TRAIN["checkpoint"], "async_save": async_save}}
    )
    ends = Ends()
    trainer, fault = fit(cfg, tmp_path / "run", ends)
    assert fault is not None and str(fault) == CAUSE
    # async: the fault of step 8 is seen when its write is collected, at most a
    # save later; the state is never past the next save
    assert trainer.step in ((8,) if not async_save else (8, 9, 10, 11, 12))
    assert_recorded(tmp_path / "run", ends, CAUSE, step=8, kept=[4])


def test_a_failing_record_write_ends_the_run_recorded(dataset, tmp_path, monkeypatch):
    def attempt_started(self, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(RunRecords, "attempt_started", attempt_started)
    ends = Ends()
    _, fault = fit(tiny_config(dataset, train=TRAIN), tmp_path / "run", ends)
    cause = (
        "I/O error while writing logs/attempts.jsonl at step 0; "
        "no valid checkpoint yet (a resume starts from step 0)"
    )
    assert fault is not None and str(fault) == cause
    root = tmp_path / "run" / "checkpoints"
    assert not list(root.iterdir())
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == cause
    [failure] = RunRecords(tmp_path / "run").failures()
    assert failure["kind"] == "storage" and failure["step"] == 0
    assert [s["error"] for s in ends.summaries] == [cause]


def test_fault_text_names_the_cause():
    assert ck.fault_text(OSError(errno.ENOSPC, "No space left on device")) == (
        "no space left on device"
    )
    assert ck.fault_text(OSError(errno.EIO, "Input/output error")) == "I/O error"
    gone = FileNotFoundError(errno.ENOENT, "No such file or directory", "/r/x")
    assert ck.fault_text(gone) == "no such file or directory: /r/x"
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = OSError(errno.ENOSPC, "full")
    assert ck.os_error_in(wrapped) is wrapped.__cause__
    assert ck.os_error_in(ValueError("no")) is None


def test_trainlab_train_on_a_full_disk_exits_74_with_the_cause_and_no_traceback(
    dataset, tmp_path, monkeypatch
):
    """The CLI end to end, with Ray Train's part (`launcher._fit`) in this process:
    what the agent returns after a storage fault (the failed summary) becomes
    TrainingFailed, exit 74 (trainlab.exitcodes.STORAGE_FAULT), the cause first."""
    from click.testing import CliRunner

    from trainlab.cli import cli
    from trainlab.config import to_yaml
    from trainlab.exitcodes import STORAGE_FAULT
    from trainlab.train.driver import launcher

    def fit_in_process(cfg, job):
        # the training process reports the fault; its agent ends the run (test_agent)
        with contextlib.suppress(ck.StorageFault):
            Trainer(job, local_loader(job), DistEnv()).fit()
        summary = RunRecords(job.run_dir).read_summary()
        assert summary is not None and summary["status"] == "failed"
        raise launcher.TrainingFailed(summary)

    real = ck.save_file

    def save_file(obj: Any, path: Path) -> None:
        if path.parent.name != f"{ckpts.STAGING_PREFIX}{ckpts.dir_name(4)}":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(obj, path)

    monkeypatch.setattr(ck, "save_file", save_file)
    monkeypatch.setattr(launcher, "_fit", fit_in_process)
    cfg = tiny_config(dataset, train={**TRAIN, "runs_root": str(tmp_path / "runs")})
    config = tmp_path / "unit.yaml"
    config.write_text(to_yaml(cfg))
    res = CliRunner().invoke(cli, ["train", str(config)], standalone_mode=False)
    assert res.exception is None, res.exception
    assert res.return_value == STORAGE_FAULT == 74
    lines = res.stderr.strip().splitlines()
    assert lines[0] == f"unit: FAILED: {CAUSE}"
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout


class Samples(Component):
    """A user's component that writes its own file into the run after every step
    (samples, a probe's output): on a full disk its write fails, not a save."""

    def __init__(self, run_dir: Path, size: int = 256 * 1024):
        self.run_dir, self.size = run_dir, size

    def after_step(self, loop, step):
        if loop.env.is_main:
            (self.run_dir / "logs" / f"samples-{step}.bin").write_bytes(b"s" * self.size)


def test_a_full_disk_in_a_components_own_write_ends_the_run_recorded(dataset, small_disk):
    """ENOSPC outside a save (issue 38, item 3): the same end as a save's, the cause
    naming the file, the failure and the summary written, the disk's reserve freed."""
    run_dir = small_disk / "run"
    ends = FillDisk(run_dir, margin=64 * 1024)
    job = make_job(tiny_config(dataset, train=TRAIN), run_dir)
    trainer = Trainer(job, local_loader(job), DistEnv(), ends)
    trainer.components.insert(-1, Samples(run_dir))
    with pytest.raises(ck.StorageFault) as raised:
        trainer.fit()
    fault = raised.value
    assert fault.error.errno == errno.ENOSPC
    step = trainer.step
    assert 4 < step < 8  # the first write after the fill, before the next save
    # (a write() that fails names no file: open() does, as in a read-only logs/)
    cause = (
        f"no space left on device while writing the run's files at step {step}; "
        "newest valid checkpoint step 4"
    )
    assert str(fault) == cause
    assert_recorded(run_dir, ends, cause, step=step, kept=[4])
    assert not (run_dir / "logs" / RESERVE).exists()  # the room held for the records freed


def test_a_storage_errno_crosses_the_agents_pipe_as_an_oserror():
    """The agent's own write for a step (its progress record) failing on a full disk
    reaches the training process as the OSError it was, so its trainer ends the run
    as a storage fault rather than an error that is restarted."""
    from trainlab.train.supervision.protocol import PipeClient, Reply

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/r/logs/progress.json")
    assert Reply.failed(RuntimeError("no errno")).os_error is None
    wrapped = RuntimeError("writing the progress")
    wrapped.__cause__ = full
    reply = Reply.failed(wrapped)
    assert reply.os_error == (errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/r/logs/progress.json")

    class Conn:
        def send(self, request):
            pass

        def recv(self):
            return reply

    with pytest.raises(OSError) as raised:
        PipeClient(Conn()).call(None)
    assert raised.value.errno == errno.ENOSPC
    assert ck.storage_error_in(raised.value, Path("/runs/r")) is not None


def test_only_storage_errors_end_a_run_as_a_storage_fault(tmp_path):
    run = tmp_path / "run"
    denied = PermissionError(errno.EACCES, "Permission denied", str(run / "logs" / "x"))
    elsewhere = PermissionError(errno.EACCES, "Permission denied", "/etc/secret")
    assert ck.storage_error_in(denied, run) is denied  # a read-only logs/
    assert ck.storage_error_in(elsewhere, run) is None  # the component's own mistake
    assert ck.storage_error_in(ConnectionRefusedError(errno.ECONNREFUSED, "x"), run) is None
    assert ck.storage_error_in(ValueError("bug"), run) is None
    rofs = OSError(errno.EROFS, "Read-only file system")
    assert ck.storage_error_in(RuntimeError("x"), run) is None
    wrapped = RuntimeError("hook failed")
    wrapped.__context__ = rofs
    assert ck.storage_error_in(wrapped, run) is rofs


@pytest.fixture
def read_only(tmp_path):
    """Makes a folder read-only as the OS enforces it: a read-only bind mount where
    this process may mount (root ignores permission bits), else its mode bits."""
    mounted: list[Path] = []

    def make(folder: Path) -> None:
        if os.geteuid() != 0:
            folder.chmod(0o555)
            return
        for args in (["--bind", str(folder), str(folder)], ["-o", "remount,ro,bind", str(folder)]):
            done = subprocess.run(["mount", *args], capture_output=True, timeout=10)
            if done.returncode != 0:
                pytest.fail(f"mount {args}: {done.stderr.decode().strip()}")
        mounted.append(folder)

    yield make
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=10)


def test_a_read_only_logs_folder_stops_a_resume_in_one_line_exit_74(
    dataset, tmp_path, monkeypatch, capsys, read_only
):
    """A run whose logs/ became read-only, extended: one line naming the file and
    the cause, exit 74 (the storage code, not 1 with a traceback), nothing started
    and the run's config and checkpoints as they were."""
    from click.testing import CliRunner

    from trainlab.cli import _run, cli
    from trainlab.config import to_yaml
    from trainlab.exitcodes import STORAGE_FAULT
    from trainlab.train.driver import launcher

    started: list[str] = []

    def fit_in_process(cfg, job):
        started.append(job.run_dir)
        return Trainer(job, local_loader(job), DistEnv()).fit()

    monkeypatch.setattr(launcher, "_fit", fit_in_process)
    cfg = tiny_config(dataset, train={**TRAIN, "runs_root": str(tmp_path / "runs")})
    config = tmp_path / "unit.yaml"
    config.write_text(to_yaml(cfg))
    res = CliRunner().invoke(cli, ["train", str(config), "--json"], standalone_mode=False)
    assert res.exception is None and res.return_value == 0, res.output
    run_dir = Path(started[0])
    before = (run_dir / "config.yaml").read_text()
    read_only(run_dir / "logs")
    capsys.readouterr()
    args = ["train", str(run_dir), "--resume", "--extend", "--set", "train.total_steps=16"]
    with pytest.raises(SystemExit) as ended:
        _run(args)
    assert ended.value.code == STORAGE_FAULT == 74
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("error: storage refused a write: ")
    assert f"{run_dir}/logs/" in err[0] and ("read-only" in err[0] or "permission" in err[0])
    assert started == [str(run_dir)]  # nothing trained
    assert (run_dir / "config.yaml").read_text() == before
    assert [i.step for i in ckpts.committed(run_dir / "checkpoints")] == [8, 12]
