"""A running run's heartbeat in MLflow, and what a missing one means.

Rank 0's MLflow callback tags its run every `TRAINLAB_HEARTBEAT_S` seconds
(default 30) with `heartbeat` (epoch seconds) and `active_seconds` (time its
training processes ran, summed over every start of the run: a resume does not
count the idle time between starts). A run MLflow still calls RUNNING whose
heartbeat is older than `TRAINLAB_LOST_AFTER_S` (default 4 beats) lost its
processes (a lost machine, a `kill -9` of the driver): `runs` and `compare`
show it as `lost`, and `mark_lost` ends its records so that the store says so
from then on (trainlab.track.lifecycle).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

log = logging.getLogger(__name__)

HEARTBEAT_TAG = "heartbeat"
ACTIVE_TAG = "active_seconds"
DEFAULT_INTERVAL_S = 30.0
MISSED_BEATS = 4


def interval_s() -> float:
    return float(os.environ.get("TRAINLAB_HEARTBEAT_S") or DEFAULT_INTERVAL_S)


def lost_after_s() -> float:
    return float(os.environ.get("TRAINLAB_LOST_AFTER_S") or MISSED_BEATS * interval_s())


class Heartbeat:
    """The heartbeat thread of one start of a run (stopped by `stop`, or with
    its process)."""

    def __init__(self, client: MlflowClient, run_id: str, active_before: float = 0.0):
        self.client, self.run_id = client, run_id
        self.active_before = active_before
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trainlab-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def active_seconds(self) -> float:
        return self.active_before + (time.time() - self.started)

    def beat(self) -> None:
        try:
            self.client.set_tag(self.run_id, HEARTBEAT_TAG, f"{time.time():.0f}")
            self.client.set_tag(self.run_id, ACTIVE_TAG, f"{self.active_seconds():.1f}")
        except Exception:  # noqa: BLE001 - a tracking outage must not end training
            log.warning("heartbeat of MLflow run %s failed", self.run_id, exc_info=True)

    def _loop(self) -> None:
        while not self._stop.wait(interval_s()):
            self.beat()

    def stop(self) -> float:
        """The last beat; returns the run's active seconds so far."""
        self._stop.set()
        self.beat()
        return self.active_seconds()


def active_before(run: Run | None) -> float:
    """The active seconds an earlier start of `run` recorded."""
    try:
        return float((run.data.tags if run else {}).get(ACTIVE_TAG) or 0.0)
    except ValueError:
        return 0.0


def is_lost(run: Run, now: float | None = None) -> bool:
    """RUNNING in MLflow, with a heartbeat older than lost_after_s() (runs from
    before heartbeats, without the tag, are never called lost)."""
    beat = run.data.tags.get(HEARTBEAT_TAG)
    if run.info.status != "RUNNING" or not beat:
        return False
    try:
        return (now or time.time()) - float(beat) > lost_after_s()
    except ValueError:
        return False
