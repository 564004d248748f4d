"""Ctrl-C in the driver (trainlab.train.driver.interrupt), with real SIGINTs to this
process: before the run directory exists it ends the command; after, the first
asks the run to stop at its next step boundary, the second stops at once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.train_helpers import dataset_dir, local_loader, make_job, tiny_config
from trainlab.run import checkpoints as ckpts
from trainlab.run.records import INTERRUPT_REASON, RunRecords
from trainlab.train.driver.interrupt import Interrupts, call_in_thread
from trainlab.train.loop.callbacks import Callback
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv


def sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs on the main thread between bytecodes


def test_before_the_run_directory_exists_ctrl_c_ends_at_once():
    with pytest.raises(KeyboardInterrupt), Interrupts():
        sigint()


def test_first_ctrl_c_asks_for_a_stop_the_second_stops_at_once(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    records = RunRecords(tmp_path)
    with Interrupts() as interrupts:
        interrupts.attach(tmp_path)
        assert not records.interrupt_requested() and not Interrupts.requested_now()
        sigint()
        assert records.interrupt_requested() and Interrupts.requested_now()
        assert "press Ctrl-C again to stop at once" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            sigint()
    assert Interrupts.active is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    records.clear_interrupt()
    assert not records.interrupt_requested()


def test_during_start_up_the_first_ctrl_c_ends_at_once(tmp_path, capsys):
    """Attached with this start's session: until its training processes completed
    a step since their newest (re)start, a first Ctrl-C stops at once (nothing to
    save; a stop at the next step would wait for the whole start-up)."""
    (tmp_path / "logs").mkdir()
    records = RunRecords(tmp_path)
    with Interrupts() as interrupts:
        interrupts.attach(tmp_path, "s1")
        assert not interrupts.training()  # Ray and the workers starting
        with pytest.raises(KeyboardInterrupt):
            sigint()
        assert "still starting" in capsys.readouterr().err
        assert not records.interrupt_requested()
        interrupts.count = 0
        records.attempt_started("s1", 0, 1)
        assert not interrupts.training()  # processes up, no step yet
        records.first_step_done("s1", 1)
        records.attempt_started("s0", 0, 1)  # another start's attempt does not count
        assert interrupts.training()
        records.attempt_started("s1", 1, 1)  # restarted in place: starting again
        assert not interrupts.training()
        records.first_step_done("s1", 2)
        sigint()  # training: the first Ctrl-C asks for a stop at the next step
        assert records.interrupt_requested() and "after the next step" in capsys.readouterr().err


def test_ctrl_c_while_the_runs_storage_does_not_answer_stops_at_once(
    tmp_path, capsys, monkeypatch
):
    """The stop is asked through the run's storage (the interrupt flag); in a store
    outage it cannot be: the first Ctrl-C says so in one line and stops at once
    (issue 38: it used to end in a traceback and exit 139)."""
    from trainlab.location import Unavailable

    (tmp_path / "logs").mkdir()

    def unavailable(*args):
        raise Unavailable("s3://b/run/logs/attempts.jsonl: Could not connect to server")

    with Interrupts() as interrupts:
        interrupts.attach(tmp_path, "s1")
        monkeypatch.setattr(RunRecords, "attempts", unavailable)
        with pytest.raises(KeyboardInterrupt):
            sigint()
        err = capsys.readouterr().err
        assert "interrupt: the run's storage does not answer (" in err
        assert "stopping now" in err and "Traceback" not in err


def test_a_second_ctrl_c_leaves_the_waiting_main_thread():
    """fit() runs on another thread (Ray Train's own SIGINT handler stays out);
    the main thread, waiting for it, still gets the KeyboardInterrupt."""
    with Interrupts() as interrupts:
        interrupts.count = 1  # as after a first Ctrl-C
        interrupts.records = RunRecords("/nonexistent")
        t0 = time.time()
        with pytest.raises(KeyboardInterrupt):
            call_in_thread(lambda: (sigint(), time.sleep(30)))
        assert time.time() - t0 < 5
    assert call_in_thread(lambda: 42) == 42
    with pytest.raises(ValueError, match="boom"):
        call_in_thread(lambda: (_ for _ in ()).throw(ValueError("boom")))


# --------------------------------------------------------------------------- in the loop


class CtrlC(Callback):
    """Rank 0's callbacks as the agent serves them after a first Ctrl-C: the reply to
    a hook carries the stop request (trainlab.train.supervision.agent) from step `at` on."""

    def __init__(self, at: int):
        self.at, self.logged = at, []

    def on_step_signals(self, step, signals):
        if step >= self.at:
            self.stop_requested, self.stop_reason = True, INTERRUPT_REASON

    def on_step_end(self, step, metrics):
        self.logged.append(step)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def interrupted_run(dataset, run_dir, min_age_s: float, every_steps: int = 8):
    """16 steps, logged every 10, checkpointed every 8; Ctrl-C seen after step 11."""
    cfg = tiny_config(
        dataset,
        train={
            "total_steps": 16,
            "log_interval": 10,
            "eval_interval": 16,
            "checkpoint": {"every_steps": every_steps, "on_interrupt_min_age_s": min_age_s},
        },
    )
    job = make_job(cfg, run_dir)
    ctrl_c = CtrlC(at=11)
    summary = Trainer(job, local_loader(job), DistEnv(), ctrl_c).fit()
    return cfg, summary, ctrl_c


def test_ctrl_c_stops_at_the_next_step_and_skips_a_checkpoint_when_the_newest_is_recent(
    dataset, tmp_path
):
    """The stop rides on the steps' all-reduced signals: rank 0 hears of it with step
    11's signals (read after step 12), sends it with step 13's, and every rank
    stops at step 14, not at the next logged step (16, the last). A checkpoint 6 steps old is
    recent enough: none is written at 14; the newest valid one (8) is the resume
    point."""
    _, summary, ctrl_c = interrupted_run(dataset, tmp_path, min_age_s=3600)
    assert summary["status"] == "interrupted" and summary["stop_reason"] == INTERRUPT_REASON
    assert summary["final_step"] == 14 and ctrl_c.logged == [10, 14]  # the stop step is logged
    assert [c.step for c in ckpts.committed(tmp_path / "checkpoints")] == [8]
    assert summary["resume_step"] == 8 and summary["dropped_steps"] == [9, 14]
    assert summary["last_checkpoint"].endswith("step-00000008")
    info = ckpts.find_resume(tmp_path / "checkpoints", require_valid=True)
    assert info is not None and info.step == 8  # what `train RUN_DIR --resume` takes


def test_ctrl_c_saves_at_the_stop_step_when_the_newest_checkpoint_is_old_enough(dataset, tmp_path):
    """on_interrupt_min_age_s: 0 always saves: the checkpoint is of the stop step."""
    _, summary, _ = interrupted_run(dataset, tmp_path, min_age_s=0)
    assert (summary["status"], summary["final_step"]) == ("interrupted", 14)
    assert summary["last_checkpoint"].endswith("step-00000014")
    assert "resume_step" not in summary
    assert ckpts.find_resume(tmp_path / "checkpoints", require_valid=True).step == 14


def test_an_early_ctrl_c_of_a_run_without_any_checkpoint_saves_one(dataset, tmp_path):
    """However young the run (min age 1 h), a Ctrl-C before its first checkpoint
    saves one at the stop: a resume continues from step 14, not from step 0."""
    _, summary, _ = interrupted_run(dataset, tmp_path, min_age_s=3600, every_steps=100)
    assert (summary["status"], summary["final_step"]) == ("interrupted", 14)
    assert summary["last_checkpoint"].endswith("step-00000014")
    assert "resume_step" not in summary and "dropped_steps" not in summary


def test_sigterm_is_the_same_graceful_stop_and_exits_143(tmp_path, capsys):
    """What a scheduler or Kubernetes sends first: the first SIGTERM asks the run to
    stop at its next step boundary (as Ctrl-C does), a second stops at once, and
    the command's exit code says which signal it was."""
    from trainlab.exitcodes import INTERRUPTED, TERMINATED

    (tmp_path / "logs").mkdir()
    records = RunRecords(tmp_path)
    with Interrupts() as interrupts:
        interrupts.attach(tmp_path)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert records.interrupt_requested()
        assert "SIGTERM: stopping after the next step" in capsys.readouterr().err
        assert Interrupts.exit_code() == TERMINATED == 143
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with Interrupts():
        assert Interrupts.exit_code() == INTERRUPTED  # a new run starts without a signal
