"""A running run's heartbeat in MLflow, and what a missing one means.

Rank 0's MLflow callback tags its run every `TRAINLAB_HEARTBEAT_S` seconds
(default 30) with `heartbeat` (epoch seconds) and `active_seconds` (time its
training processes ran, summed over every start of the run: a resume does not
count the idle time between starts). A run MLflow still calls RUNNING whose
heartbeat is older than `TRAINLAB_LOST_AFTER_S` (default 4 beats) lost its
processes (a lost machine, a `kill -9` of the driver). The next trainlab
command that opens the store (trainlab.track.backend.client_for: `runs`,
`compare`, `train`'s record, `tune`, `mix`, `export`, the notebooks) ends its
records with `correct_lost`: MLflow FAILED with the status tag `lost`, and its
run directory's run_summary.json status `lost` where this machine sees it. One
query of the store's RUNNING runs; nothing more unless one is lost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from trainlab.runstatus import RunStatus

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

log = logging.getLogger(__name__)

HEARTBEAT_TAG = "heartbeat"
ACTIVE_TAG = "active_seconds"
DEFAULT_INTERVAL_S = 30.0
MISSED_BEATS = 4
MAX_RUNNING = 1000  # RUNNING runs looked at per store opening (one page)


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


def correct_lost(client: MlflowClient) -> list[str]:
    """End every run of the store that MLflow calls RUNNING but whose heartbeat
    stopped (`is_lost`); returns their run ids. One search of the RUNNING runs
    (their experiments' ids first); never raises (a store that cannot answer is
    left as it is)."""
    try:
        ids = [e.experiment_id for e in client.search_experiments()]
        if not ids:
            return []
        running = client.search_runs(
            ids,
            filter_string=f"attributes.status = 'RUNNING' and tags.{HEARTBEAT_TAG} != ''",
            max_results=MAX_RUNNING,
        )
        lost = [r for r in running if is_lost(r) and not _restarting(r)]
        for run in lost:
            end_lost(client, run)
        return [r.info.run_id for r in lost]
    except Exception as e:  # noqa: BLE001 - correcting others' records must not fail a command
        log.warning("could not check the store for lost runs: %s", e)
        return []


def _restarting(run: Run) -> bool:
    """The run's directory records a start within lost_after_s(): it is being
    resumed (its first beat is on its way), not lost. The store is opened by
    that very start (its MLflow callback) before it beats."""
    from trainlab.run.records import RunRecords

    run_dir = run.data.tags.get("run_dir")
    if not run_dir:
        return False
    started = [float(a.get("time") or 0.0) for a in RunRecords(run_dir).attempts()]
    return bool(started) and time.time() - max(started) < lost_after_s()


def end_lost(client: MlflowClient, run: Run) -> dict[str, Any] | None:
    """End a lost run's records: its run directory's summary (when this machine
    sees it; also logged as the run's `run_summary.json` artifact) and the MLflow
    run (FAILED, status tag `lost`)."""
    from trainlab.track.ended import write_ended_summary

    last = time.localtime(float(run.data.tags[HEARTBEAT_TAG]))
    reason = f"lost: no heartbeat since {time.strftime('%Y-%m-%d %H:%M:%S', last)}"
    summary = None
    run_dir = run.data.tags.get("run_dir")
    if run_dir:
        try:
            summary = write_ended_summary(run_dir, RunStatus.LOST, reason)
        except (OSError, ValueError) as e:
            log.warning("could not mark %s lost: %s", run_dir, e)
    # Whatever the run directory said, the store must stop calling it running.
    client.set_tag(run.info.run_id, "status", RunStatus.LOST)
    client.set_terminated(run.info.run_id, "FAILED")
    if summary is not None:
        try:
            client.log_dict(run.info.run_id, summary, "run_summary.json")
        except Exception as e:  # noqa: BLE001 - the status above is what matters
            log.warning("could not log the lost run's summary: %s", e)
    log.info("run %s (%s): %s; marked lost", run.info.run_name, run.info.run_id, reason)
    return summary
