"""Metric points to MLflow from a background thread, so a training step never
waits for the store (a SQLite commit costs tens of milliseconds on a busy disk;
rank 0 would hold every other rank at the next collective meanwhile).

Points are written in the order they were queued; whatever queued up while a
write was in flight goes out in one batch. A failed write is logged and
dropped: a tracking outage must not end training. `flush()` waits until what
was queued before it is written.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

log = logging.getLogger(__name__)

METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
FLUSH_TIMEOUT_S = 120.0


class MetricWriter:
    def __init__(self, client: Any, run_id: str):
        self.client = client
        self.run_id = run_id
        self.failed_batches = 0
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, name="trainlab-mlflow-metrics", daemon=True
        )
        self._thread.start()

    def put(self, points: list[Any]) -> None:
        if points:
            self._queue.put(points)

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until everything queued so far is written (or failed); False on timeout."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        stop = False
        while not stop:
            items = [self._queue.get()]
            while True:  # take everything that queued up meanwhile
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            points = [p for item in items if isinstance(item, list) for p in item]
            self._write(points)
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()
                stop = stop or item is None

    def _write(self, points: list[Any]) -> None:
        for i in range(0, len(points), METRICS_PER_BATCH):
            try:
                self.client.log_batch(self.run_id, metrics=points[i : i + METRICS_PER_BATCH])
            except Exception as e:  # noqa: BLE001 - a tracking outage must not end training
                self.failed_batches += 1
                log.warning(
                    "MLflow: %d metric points not logged (%s)",
                    len(points[i : i + METRICS_PER_BATCH]),
                    e,
                )
