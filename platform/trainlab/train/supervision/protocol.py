"""The pipe protocol between a training process (the child) and its agent.

The child sends one request at a time and waits for its `Reply`; the agent
(trainlab.train.supervision.agent) serves them. Requests are frozen dataclasses, one per
kind, so both sides agree on names and arguments at import time:

    NextStep()               the next (step, micro_batches) of the stream, None at its end
    IterFrom(step)           (re)start the stream at `step` (the agent prefetches it)
    LoaderCall(method, args) one of the loader's other calls (LOADER_CALLS, derived
                             from trainlab.train.loop.stream.StreamLoader):
                             validation batches, delivered shares, its state
    Hook(name, args)         a callback hook of rank 0; the reply carries a StopRequest
    Failed(step, message)    the child failed (the agent records it; then it exits 1)
    Done()                   the child completed (the agent drains rank 0's callbacks)

The client side lives here too: `PipeClient` (one round trip at a time, from
any thread), `PipeLoader` (the agent's data stream seen from the child, with a
prefetch of PREFETCH_STEPS steps) and `PipeCallbacks` (rank 0's callbacks, run
by the agent; a stop request comes back with each reply).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainlab.train.loop.callbacks import FORWARDED_HOOKS, Callback, derive_calls
from trainlab.train.loop.stream import LOADER_CALLS, StreamLoader

if TYPE_CHECKING:
    from trainlab.train.job import TrainJob

PREFETCH_STEPS = 4


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class NextStep:
    pass


@dataclass(frozen=True)
class IterFrom:
    step: int


@dataclass(frozen=True)
class LoaderCall:
    """One call of the agent's loader: `method` one of LOADER_CALLS (declared once,
    by trainlab.train.loop.stream.StreamLoader), with `args`."""

    method: str
    args: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in LOADER_CALLS:
            raise ValueError(f"loader call {self.method!r} not in {sorted(LOADER_CALLS)}")


# The Callback hooks a training process forwards (declared once, on Callback).
HOOKS = frozenset(FORWARDED_HOOKS)


@dataclass(frozen=True)
class Hook:
    name: str  # one of HOOKS
    args: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.name not in HOOKS:
            raise ValueError(f"hook {self.name!r} not in {sorted(HOOKS)}")


@dataclass(frozen=True)
class Failed:
    step: int | None
    message: str  # "ExceptionType: first line", at most 500 characters


@dataclass(frozen=True)
class Done:
    pass


Request = NextStep | IterFrom | LoaderCall | Hook | Failed | Done


# --------------------------------------------------------------------------- replies


@dataclass(frozen=True)
class StopRequest:
    """Rank 0's callbacks' stop decision, as of the newest hook the agent ran."""

    requested: bool = False
    reason: str = ""


@dataclass(frozen=True)
class Reply:
    """The agent's answer: `value`, or `error` (the text the child raises). An
    error that was an OSError with an errno (the agent's write of a record on a full
    disk) carries it, `os_error` (errno, strerror, filename), so the child raises
    an OSError its trainer can tell a storage fault by (`ck.storage_error_in`)."""

    value: Any = None
    error: str | None = None
    os_error: tuple[int, str, str | None] | None = None

    @classmethod
    def failed(cls, e: BaseException) -> Reply:
        from trainlab.train.checkpoint import os_error_in

        found = os_error_in(e)
        os_error = None
        if found is not None and found.errno is not None:
            filename = None if found.filename is None else str(found.filename)
            os_error = (found.errno, found.strerror or str(found), filename)
        return cls(error=f"{type(e).__name__}: {e}", os_error=os_error)


# --------------------------------------------------------------------------- the child's start


@dataclass(frozen=True)
class ChildArgs:
    """What an agent hands its training process (pickled through the fork server)."""

    job: TrainJob
    rank: int
    world_size: int
    local_rank: int
    device: str
    master_addr: str
    master_port: int


# --------------------------------------------------------------------------- client side


class PipeClient:
    """Round trips to the agent; a lock keeps one request in flight at a time."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.lock = threading.Lock()

    def call(self, request: Request) -> Any:
        with self.lock:
            self.conn.send(request)
            reply: Reply = self.conn.recv()
        if reply.os_error is not None:
            raise OSError(*reply.os_error)
        if reply.error is not None:
            raise RuntimeError(reply.error)
        return reply.value


class PipeLoader:
    """The agent's data stream, seen from the training process
    (trainlab.train.loop.stream.StreamLoader)."""

    def __init__(self, client: PipeClient):
        self.client = client

    def iter_from(self, step: int) -> Iterator[Any]:
        """Steps from `step`, requested PREFETCH_STEPS ahead (in order, by one fetch
        thread) so that the round trip to the agent overlaps the current step's compute."""
        self.client.call(IterFrom(step))
        fetch = ThreadPoolExecutor(1, thread_name_prefix="trainlab-fetch")
        try:
            ahead = deque(fetch.submit(self.client.call, NextStep()) for _ in range(PREFETCH_STEPS))
            while True:
                item = ahead.popleft().result()  # re-raises a failed round trip here
                if item is None:  # the end of the stream
                    return
                ahead.append(fetch.submit(self.client.call, NextStep()))
                yield item
        finally:
            fetch.shutdown(wait=False, cancel_futures=True)

    def _call(self, method: str, *args: Any) -> Any:
        return self.client.call(LoaderCall(method, args))


# PipeLoader's other methods: one round trip each, derived from StreamLoader.
derive_calls(PipeLoader, LOADER_CALLS, "_call", docs=StreamLoader)


class PipeCallbacks(Callback):
    """Rank 0's callbacks, run by the agent; a stop request comes back with each reply
    (the agent runs hooks off its main thread, so a stop a hook asks for arrives with
    the reply to a later hook). One method per forwarded hook, derived from Callback."""

    def __init__(self, client: PipeClient):
        self.client = client
        self._stop = StopRequest()

    def _hook(self, name: str, *args: Any) -> None:
        self._stop = self.client.call(Hook(name, args))

    @property
    def stop_requested(self) -> bool:  # type: ignore[override]
        return self._stop.requested

    @property
    def stop_reason(self) -> str:  # type: ignore[override]
        return self._stop.reason


derive_calls(PipeCallbacks, FORWARDED_HOOKS, "_hook")
