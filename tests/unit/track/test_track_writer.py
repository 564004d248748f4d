"""The background metric writer against a fake client: points in put order, what
queued during a write coalesced into the next one, MLflow's 1000-metric batch
limit, failed writes counted (never raised), and flush waiting for what came
before it (bounded)."""

from __future__ import annotations

import threading
import time

from trainlab.track.writer import METRICS_PER_BATCH, MetricWriter


class FakeClient:
    """Records log_batch calls; `gate` (when set) holds each write until released."""

    def __init__(self, fail: bool = False):
        self.batches: list[list[int]] = []
        self.fail = fail
        self.gate: threading.Event | None = None
        self.writing = threading.Event()
        self.threads: set[str] = set()

    def log_batch(self, run_id: str, metrics: list[int]) -> None:
        assert run_id == "run"
        self.threads.add(threading.current_thread().name)
        self.writing.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise ConnectionError("store down")
        self.batches.append(list(metrics))


def test_points_are_written_in_order_off_the_callers_thread():
    client = FakeClient()
    writer = MetricWriter(client, "run")
    for step in range(50):
        writer.put([step * 2, step * 2 + 1])
    assert writer.flush()
    assert [p for batch in client.batches for p in batch] == list(range(100))
    assert threading.current_thread().name not in client.threads
    writer.close()


def test_points_queued_during_a_write_go_out_in_one_batch():
    client = FakeClient()
    client.gate = threading.Event()
    writer = MetricWriter(client, "run")
    writer.put([0])
    assert client.writing.wait(10)  # the first write is in flight, held
    t0 = time.perf_counter()
    for p in range(1, 11):
        writer.put([p])
    assert time.perf_counter() - t0 < 0.5  # put never waits for the store
    client.gate.set()
    assert writer.flush()
    assert client.batches == [[0], list(range(1, 11))]
    writer.close()


def test_batches_respect_mlflows_limit():
    client = FakeClient()
    writer = MetricWriter(client, "run")
    writer.put(list(range(2 * METRICS_PER_BATCH + 5)))
    writer.close()
    assert [len(b) for b in client.batches] == [METRICS_PER_BATCH, METRICS_PER_BATCH, 5]


def test_a_store_outage_is_counted_and_never_raised(caplog):
    writer = MetricWriter(FakeClient(fail=True), "run")
    writer.put(list(range(METRICS_PER_BATCH + 1)))
    assert writer.flush()
    assert writer.failed_batches == 2
    assert "metric points not logged (store down)" in caplog.text
    writer.close()


def test_flush_is_bounded_and_close_stops_accepting_points(caplog):
    client = FakeClient()
    client.gate = threading.Event()
    writer = MetricWriter(client, "run")
    writer.put([1])
    assert client.writing.wait(10)
    assert writer.flush(timeout=0.2) is False  # the store hangs: flush gives up
    client.gate.set()
    assert writer.flush()
    writer.close()
    writer.put([2])  # after close: dropped with a warning, not raised
    assert writer.flush()
    assert client.batches == [[1]]
    assert "put after close" in caplog.text
