"""The typed pipe protocol, in one process: requests survive the pipe, and the
client side (PipeLoader, PipeCallbacks) against the agent's real request
handling (`Agent._serve`) in a thread, with the fake stream of test_agent."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any

import numpy as np
import pytest

from tests.unit.train.test_agent import FakeLoader, Recorder, make_job
from trainlab.run.records import RunRecords
from trainlab.train.loop.callbacks import Callback
from trainlab.train.supervision.agent import Agent, Feeder, LocalRendezvous
from trainlab.train.supervision.protocol import (
    PREFETCH_STEPS,
    Done,
    Failed,
    Hook,
    IterFrom,
    LoaderCall,
    NextStep,
    PipeCallbacks,
    PipeClient,
    PipeLoader,
    Reply,
    StopRequest,
)

pytestmark = pytest.mark.timeout(30)

REQUESTS = [
    NextStep(),
    IterFrom(3),
    LoaderCall("validation_batches", ("code", 2)),
    LoaderCall("delivered_shares", (7,)),
    LoaderCall("state_dict", (7,)),
    LoaderCall("state_dict"),
    LoaderCall("load_state_dict", ({"step": 7, "sources": {"code": [1, 2]}},)),
    Hook("on_step_end", (5, {"loss": 2.5})),
    Failed(None, "RuntimeError: x"),
    Failed(4, "ValueError: loss is nan"),
    Done(),
]


def test_every_request_and_reply_survives_the_pipe():
    a, b = mp.Pipe()
    for message in [*REQUESTS, Reply(), Reply(StopRequest(True, "p0")), Reply(error="boom")]:
        a.send(message)
        got = b.recv()
        assert got == message and type(got) is type(message)


def test_only_callback_hooks_and_loader_calls_are_forwarded():
    with pytest.raises(ValueError, match="not in"):
        Hook("__init__")
    with pytest.raises(ValueError, match="not in"):
        LoaderCall("__class__")


class Served:
    """An agent serving one pipe end in a thread; the client side on the other."""

    def __init__(self, tmp_path, loader: Any = None, callbacks: Callback | None = None):
        self.job = make_job(tmp_path)
        self.loader = loader or FakeLoader()
        self.agent = Agent(
            self.job,
            0,
            1,
            0,
            "cpu",
            self.loader,
            callbacks,
            rendezvous=LocalRendezvous(),
            mp_context=mp.get_context("fork"),  # never used: no process starts
        )
        ours, theirs = mp.Pipe()
        self.client = PipeClient(theirs)
        self.outcomes: list[str | None] = []
        self.thread = threading.Thread(target=self._serve, args=(ours,), daemon=True)
        self.thread.start()

    def _serve(self, conn: Any) -> None:
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            self.outcomes.append(self.agent._serve(conn, request, "g-0"))

    def close(self) -> None:
        self.client.conn.close()
        self.thread.join(5)


def test_loader_requests_round_trip(tmp_path):
    served = Served(tmp_path)
    loader = PipeLoader(served.client)
    steps = list(loader.iter_from(2))
    assert [s for s, _ in steps] == [2, 3, 4, 5]
    np.testing.assert_array_equal(steps[0][1][0]["input_ids"], np.full((2, 4), 2))
    batches = loader.validation_batches("docs", 2)
    assert len(batches) == 2 and batches[0]["input_ids"].dtype == np.int32
    assert loader.delivered_shares(4) == {"code": 0.7, "docs": 0.3}
    assert loader.state_dict(4) == {"step": 4}
    loader.load_state_dict({"step": 4})
    assert served.loader.loaded == [{"step": 4}]
    # An error of the agent's loader is raised in the training process, by type and text.
    with pytest.raises(RuntimeError, match="KeyError: 'nope'"):
        loader.validation_batches("nope", 1)
    assert served.client.call(Done()) is None
    served.close()
    assert served.outcomes[-1] == "done"


def test_next_step_before_iter_from_is_an_error(tmp_path):
    served = Served(tmp_path)
    with pytest.raises(RuntimeError, match="NextStep before IterFrom"):
        served.client.call(NextStep())
    with pytest.raises(RuntimeError, match="unknown request"):
        served.client.call("next")  # the old string verbs are gone


def test_a_failing_stream_fails_the_training_process(tmp_path):
    served = Served(tmp_path, FakeLoader(steps=10, fail_at=3))
    got = []
    with pytest.raises(RuntimeError, match="data stream failed: OSError: shard unreadable"):
        for step, _ in PipeLoader(served.client).iter_from(0):
            got.append(step)
    assert got == [0, 1, 2]


def test_prefetch_stays_a_few_steps_ahead(tmp_path):
    served = Served(tmp_path, FakeLoader(steps=1000))
    stream = PipeLoader(served.client).iter_from(0)
    assert next(stream)[0] == 0
    time.sleep(0.3)  # let both sides prefetch as far as they go
    # The child asks PREFETCH_STEPS ahead; the agent's Feeder pulls PREFETCH_STEPS
    # ahead of what it served.
    assert served.loader.pulled <= 1 + 2 * PREFETCH_STEPS
    assert [next(stream)[0] for _ in range(20)] == list(range(1, 21))
    stream.close()


def test_feeder_stops_pulling_when_stopped():
    loader = FakeLoader(steps=1000)
    feeder = Feeder(loader, 10)
    assert feeder.next()[0] == 10
    feeder.stop()
    time.sleep(0.1)
    pulled = loader.pulled
    time.sleep(0.1)
    assert loader.pulled == pulled <= 2 + PREFETCH_STEPS


def test_feeder_repeats_the_end_of_the_stream():
    feeder = Feeder(FakeLoader(steps=2), 0)
    assert [feeder.next()[0], feeder.next()[0]] == [0, 1]
    assert feeder.next() is None and feeder.next() is None


class Slow(Recorder):
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        time.sleep(0.1)
        if step == 2:
            raise ConnectionError("tracking server down")  # logged, never ends training
        super().on_step_end(step, metrics)


def test_hooks_run_in_order_off_the_main_thread_and_done_drains_them(tmp_path):
    recorder = Slow(stop_at=3)
    served = Served(tmp_path, callbacks=recorder)
    callbacks = PipeCallbacks(served.client)
    t0 = time.perf_counter()
    for step in range(1, 6):
        callbacks.on_step_end(step, {"loss": 1.0})
    assert time.perf_counter() - t0 < 0.3  # the child did not wait for the hooks (0.5 s)
    assert not callbacks.stop_requested  # the stop comes with a later reply
    served.client.call(Done())  # drains: every hook has run when Done returns
    assert recorder.events == [("step", 1), ("step", 3), ("step", 4), ("step", 5)]
    callbacks.on_run_end({"status": "stopped"})
    assert callbacks.stop_requested and callbacks.stop_reason == "test asked"
    assert RunRecords(served.job.run_dir).last_logged_step() == 5
    served.close()


def test_a_reported_failure_is_recorded(tmp_path):
    served = Served(tmp_path)
    served.client.call(Failed(7, "RuntimeError: Connection reset by peer"))
    [failure] = RunRecords(served.job.run_dir).failures("s1")
    assert failure["event"] == "g-0" and failure["step"] == 7 and failure["kind"] == "peer"
    assert failure["error"] == "rank 0 failed at step 7: RuntimeError: Connection reset by peer"
    served.close()
    assert served.outcomes == ["failed"]
