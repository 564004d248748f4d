"""What the driver says while a run starts (trainlab.train.driver.startup): the
wait before an attempt is recorded is not called "Ray placing the workers" (it
said so after the workers had met), and once an attempt started it is the first
step that is awaited. A real run directory's records; the note's period shortened."""

from __future__ import annotations

import time

from trainlab.run.records import RunRecords
from trainlab.train.driver import startup


def test_the_notes_say_what_is_awaited(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(startup, "NOTE_EVERY_S", 0.05)
    (tmp_path / "logs").mkdir()
    notes = startup.StartupNotes(enabled=True)
    with notes.waiting(tmp_path, "s1", 2):
        time.sleep(0.2)
        before = capsys.readouterr().err
        RunRecords(tmp_path).attempt_started("s1", 0, 2)
        time.sleep(0.2)
        after = capsys.readouterr().err
    assert "for the 2 worker(s) to be placed and their training processes to start" in before
    assert "Ray to place" not in before
    assert "for the training processes' first step" in after.splitlines()[-1]

