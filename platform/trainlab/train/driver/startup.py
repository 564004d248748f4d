"""What `trainlab train` waits for while it starts, said on stderr.

Between the checks and the first progress line a run starts Ray (or connects
to it), has Ray place its workers, starts the training processes and their
process group, builds the model and reads the first batches: on a busy machine
that took two minutes without a line. The driver now says each phase as it
begins and, every `NOTE_EVERY_S` until this start's training processes are past
their first step, what it still waits for and for how long.

Said only where the driver runs on the main thread (the `trainlab train`
command, `trainers/pretrain.py`); a run inside a Tune trial or the mix swarm
keeps quiet (their own progress lines say how they go).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from trainlab.run.records import RunRecords

NOTE_EVERY_S = 20.0


class StartupNotes:
    def __init__(self, enabled: bool | None = None) -> None:
        if enabled is None:
            enabled = threading.current_thread() is threading.main_thread()
        self.enabled = enabled
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        if self.enabled:
            print(f"starting: {text}", file=sys.stderr, flush=True)

    def ray(self) -> None:
        """Before connecting to Ray (the local cluster of `trainlab cluster up`:
        `ensure_ray` says so itself)."""
        from trainlab.raycluster import from_local_cluster

        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():  # `--repeats`' next seed, a Tune trial
            self.say("Ray already up in this process (one cluster for all its runs)")
            return
        address = os.environ.get("RAY_ADDRESS")
        if from_local_cluster(address):
            return
        self.say(
            f"connecting to the Ray cluster at {address}"
            if address
            else "starting a local Ray cluster (RAY_ADDRESS unset)"
        )

    def workers(self, num_workers: int, cpus: float, gpu: bool) -> None:
        """Ray is ready; the workers are next."""
        each = f"{cpus:g} CPU{' + 1 GPU' if gpu else ''} each"
        self.say(
            f"Ray ready after {time.monotonic() - self.t0:.0f} s; placing {num_workers} "
            f"training worker(s) ({each}) and starting their processes"
        )

    @contextlib.contextmanager
    def waiting(self, run_dir: Any, session: str, num_workers: int) -> Iterator[None]:
        """While the body runs: until the training processes of `session` completed
        a step, every NOTE_EVERY_S a line with what is still awaited."""
        if not self.enabled:
            yield
            return
        done = threading.Event()
        records = RunRecords(run_dir)

        def note() -> None:
            while not done.wait(NOTE_EVERY_S):
                try:
                    started = [a for a in records.attempts() if a.get("session") == session]
                    stepped = [a for a in records.first_steps() if a.get("session") == session]
                except OSError:
                    continue
                if started and len(stepped) >= len(started):
                    return  # training: the progress lines take over
                # Before an attempt is recorded the driver cannot tell placing from
                # starting (the workers may have met already: their lines say so).
                what = (
                    "the training processes' first step (model, data, process group)"
                    if started
                    else f"the {num_workers} worker(s) to be placed and their training "
                    "processes to start (a busy or full cluster waits at placing)"
                )
                self.say(f"still waiting after {time.monotonic() - self.t0:.0f} s for {what}")

        thread = threading.Thread(target=note, name="trainlab-startup-notes", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
