"""Ctrl-C in the driver (trainlab.train.interrupt), with real SIGINTs to this
process: before the run directory exists it ends the command; after, the first
asks the run to stop at its next logged step, the second stops at once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from trainlab.train.interrupt import Interrupts, call_in_thread
from trainlab.train.records import RunRecords


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
