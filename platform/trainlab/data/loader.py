"""`WorkerLoader`: one training rank's view of the stream, fed by Ray Data.

Each rank runs its own small Ray Data pipeline: a dataset of step numbers
(`from_numpy`, so no read tasks) -> `map_batches(pack_steps)`, tasks that
compute that rank's rows of each step from the TrainStream -> an ordered
iterator in the training worker. That is "a Ray Data iterator per rank"
rather than `streaming_split`, because exactness needs rank r to get exactly
its rows of each step, which a dynamic split does not promise. Ray reuses
worker processes, and each keeps its corpus and schedule, so a task pays for
packing only.

Resources are capped per pipeline: tasks ask for `data.loader_cpus /
world_size` CPUs and the dataset's resource limit is the same, so the data side
never takes the CPUs the training workers hold (the 2-core deadlock in
docs/ray-resources.md) and never grows beyond its budget.

With Ray Data, `iter_from` starts the pipeline at once and keeps a few steps
ready in a background thread, so setup overlaps the model's and training
rarely waits.
Without a running Ray (unit tests, notebooks) the same rows are computed in
process (`backend="local"`); `auto` picks Ray Data whenever Ray is initialized.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from trainlab.data.mix import BlendSchedule
from trainlab.data.pack import BATCH_KEYS, Batch, PackedRows
from trainlab.data.spec import DataSpec, rows_per_rank
from trainlab.data.stream import TrainStream, split_micro_batches
from trainlab.errors import UserError

log = logging.getLogger(__name__)

Backend = Literal["auto", "ray_data", "local"]
META_KEYS = ("row_source", "row_doc_starts", "row_split")
# Steps per Ray Data block: enough tokens per task to amortize Ray's per-task
# overhead (~0.1 s on a busy 2-core machine), few enough that the first step
# arrives quickly (packing runs at ~2M tokens/s, so a block takes ~0.5 s).
TOKENS_PER_BLOCK = 1 << 20
MAX_STEPS_PER_BLOCK = 256
# Steps kept ready ahead of training.
PREFETCH_STEPS = 4


@dataclass
class Delivery:
    """What this rank actually received (counted from the delivered rows)."""

    steps: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    doc_starts: dict[str, int] = field(default_factory=dict)
    rows_split: int = 0
    tokens: int = 0
    padding_tokens: int = 0

    def add(self, spec: DataSpec, batch: Batch, meta: dict[str, np.ndarray]) -> None:
        self.steps += 1
        self.tokens += batch["input_ids"].size
        self.padding_tokens += int((batch["document_ids"] < 0).sum())
        self.rows_split += int(meta["row_split"].sum())
        for i, name in enumerate(spec.sources):
            mask = meta["row_source"] == i
            self.rows[name] = self.rows.get(name, 0) + int(mask.sum())
            self.doc_starts[name] = self.doc_starts.get(name, 0) + int(
                meta["row_doc_starts"][mask].sum()
            )


def _meta(packed: PackedRows) -> dict[str, np.ndarray]:
    return {
        "row_source": packed.row_source,
        "row_doc_starts": packed.row_doc_starts,
        "row_split": packed.row_split,
    }


# One TrainStream per process and DataSpec: Ray reuses worker processes across
# tasks, so the corpus is read and the blend schedule advanced once per process.
_STREAMS: dict[DataSpec, TrainStream] = {}


def _stream_for(spec: DataSpec) -> TrainStream:
    stream = _STREAMS.get(spec)
    if stream is None:
        _STREAMS.clear()
        stream = _STREAMS[spec] = TrainStream(spec)
    return stream


def packed_steps(
    stream: TrainStream, first: int, count: int, rank: int, world_size: int
) -> dict[str, np.ndarray]:
    """Steps [first, first + count) of one rank as a block: "step" [count] and every
    batch and bookkeeping array with a leading step axis ([count, rows, ...])."""
    packed = stream.rank_rows(first, rank, world_size, steps=count)
    out = {"step": np.arange(first, first + count, dtype=np.int64)}
    for key in BATCH_KEYS:
        out[key] = packed.batch[key].reshape(count, -1, stream.spec.seq_len)
    for key, value in _meta(packed).items():
        out[key] = value.reshape(count, -1)
    return out


def pack_steps(
    batch: dict[str, np.ndarray], spec: DataSpec, rank: int, world_size: int
) -> dict[str, np.ndarray]:
    """Ray Data map: a block of consecutive step numbers in, this rank's packed rows
    of those steps out (one output row per step)."""
    steps = batch["data"].astype(np.int64).ravel()
    if len(steps) and not np.array_equal(steps, np.arange(steps[0], steps[0] + len(steps))):
        raise ValueError(f"pack_steps needs consecutive steps, got {steps[:8]}...")
    if not len(steps):
        return packed_steps(_stream_for(spec), 0, 0, rank, world_size)
    return packed_steps(_stream_for(spec), int(steps[0]), len(steps), rank, world_size)


_DONE = object()


def _prefetch(items: Iterator, depth: int) -> Iterator:
    """Run `items` in a daemon thread, `depth` items ahead; stops when the consumer
    goes away. Errors are re-raised in the consumer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(x: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for x in items:
                if not put(x):
                    return
            put(_DONE)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put(e)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    threading.Thread(target=run, name="trainlab-data-prefetch", daemon=True).start()

    def consume() -> Iterator:
        try:
            while True:
                x = q.get()
                if x is _DONE:
                    return
                if isinstance(x, BaseException):
                    raise x
                yield x
        finally:
            stop.set()

    return consume()


class _WarningsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and not record.getMessage().startswith(
            "Progress bars disabled"
        )


def _quiet_ray_data_console() -> None:
    """Ray Data logs every dataset's start and progress to the console; a training
    worker starts one per attempt. Warnings still show; its log files keep the rest."""
    import ray.data  # noqa: F401 - configures the "ray.data" logger and its handlers

    for handler in logging.getLogger("ray.data").handlers:
        if type(handler).__name__ == "PlainRayHandler" and not any(
            isinstance(f, _WarningsOnly) for f in handler.filters
        ):
            handler.addFilter(_WarningsOnly())


def _no_ray_data_metric_pushes() -> None:
    """Stop this process's Ray Data executors and iterators from pushing metrics to
    Ray Data's stats actor (`data.ray_data_metrics: false`). They push every 5 s
    per dataset; measured on 2 cores (make bench, train_step_throughput), the
    pushes and the actor's handling of them took ~9% of training throughput
    (window medians 7.3-7.8k vs 8.4-8.9k tokens/s without). Ray has no switch for
    it, so the two senders of `_StatsManager` become no-ops; Ray Data's own
    bookkeeping (backpressure, `Dataset.stats()`) is untouched. Ray is pinned
    (pyproject.toml), and that release has `_StatsManager`; an upgrade that moves
    it fails here rather than silently losing the patch, and one that renames the
    two senders leaves them unpatched (the loader works as before)."""
    from ray.data._internal.stats import _StatsManager

    for name in ("update_execution_metrics", "update_iteration_metrics"):
        if hasattr(_StatsManager, name):
            setattr(_StatsManager, name, staticmethod(_drop_metrics))


def _drop_metrics(*args: Any, **kwargs: Any) -> None:
    return None


def _unblock(block: dict[str, np.ndarray]) -> Iterator[tuple[int, Batch, dict]]:
    for i, s in enumerate(block["step"].tolist()):
        yield (int(s), {k: block[k][i] for k in BATCH_KEYS}, {k: block[k][i] for k in META_KEYS})


def _resolve_backend(backend: Backend) -> Literal["ray_data", "local"]:
    if backend != "auto":
        return backend
    import ray

    return "ray_data" if ray.is_initialized() else "local"


class WorkerLoader:
    """Rank `rank` of `world_size`: micro batches of each global step, in order.

    `iter_from(step)` yields `(step, micro_batches)` for step, step+1, ... up to
    `spec.total_steps` (or `end`). After a step is yielded, `state_dict()` says the
    next step is step+1, so a checkpoint written after training on it resumes
    after it."""

    def __init__(
        self, spec: DataSpec, rank: int = 0, world_size: int = 1, backend: Backend = "auto"
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.spec = spec
        self.rank, self.world_size = rank, world_size
        self.rows_per_rank = rows_per_rank(spec, world_size)
        self.backend = _resolve_backend(backend)
        self.delivery = Delivery()
        self._next_step = 0
        self._stream: TrainStream | None = None
        self._schedule = BlendSchedule(spec.weights)

    # ------------------------------------------------------------------ the stream

    @property
    def stream(self) -> TrainStream:
        """The in-process stream (loads the corpus on first use)."""
        if self._stream is None:
            self._stream = TrainStream(self.spec)
        return self._stream

    @property
    def step(self) -> int:
        """The next step this loader will deliver."""
        return self._next_step

    def iter_from(
        self, step: int | None = None, end: int | None = None
    ) -> Iterator[tuple[int, list[Batch]]]:
        """(step, micro batches) for steps [step, end); `end` defaults to
        spec.total_steps, `step` to the loaded state's step. Work starts now."""
        start = self._next_step if step is None else step
        stop = self.spec.total_steps if end is None else end
        self._next_step = start
        if self.backend == "local":  # in process: a thread would only add GIL hand-offs
            return self._deliver(self._iter_local(start, stop))
        return self._deliver(_prefetch(self._iter_ray_data(start, stop), PREFETCH_STEPS))

    def _deliver(
        self, items: Iterator[tuple[int, Batch, dict]]
    ) -> Iterator[tuple[int, list[Batch]]]:
        for s, batch, meta in items:
            if s != self._next_step:  # exactness is the point: never deliver out of order
                raise RuntimeError(f"loader delivered step {s}, expected {self._next_step}")
            self.delivery.add(self.spec, batch, meta)
            self._next_step = s + 1
            yield s, split_micro_batches(batch, self.spec.micro_batch_size)

    def _iter_local(self, start: int, stop: int) -> Iterator[tuple[int, Batch, dict]]:
        per_block = self._steps_per_block()
        for first in range(start, stop, per_block):
            block = packed_steps(
                self.stream, first, min(per_block, stop - first), self.rank, self.world_size
            )
            yield from _unblock(block)

    def _steps_per_block(self) -> int:
        tokens = self.rows_per_rank * self.spec.seq_len
        return max(1, min(MAX_STEPS_PER_BLOCK, TOKENS_PER_BLOCK // tokens))

    def build_dataset(self, start: int, stop: int) -> Any:
        """This rank's Ray Data pipeline for steps [start, stop) (not yet executing)."""
        import ray.data
        from ray.data import ExecutionResources

        per_block = self._steps_per_block()
        blocks = [
            np.arange(b, min(b + per_block, stop), dtype=np.int64)
            for b in range(start, stop, per_block)
        ]
        cpus = self.spec.loader_cpus / self.world_size
        _quiet_ray_data_console()
        if not self.spec.ray_data_metrics:
            _no_ray_data_metric_pushes()
        ds = ray.data.from_numpy(blocks).map_batches(
            pack_steps,
            fn_kwargs={"spec": self.spec, "rank": self.rank, "world_size": self.world_size},
            batch_size=None,
            num_cpus=cpus,
            batch_format="numpy",
            zero_copy_batch=True,
        )
        ctx = ds.context
        ctx.execution_options.preserve_order = True
        ctx.execution_options.resource_limits = ExecutionResources(cpu=cpus)
        ctx.enable_progress_bars = False
        return ds

    def _iter_ray_data(self, start: int, stop: int) -> Iterator[tuple[int, Batch, dict]]:
        if start >= stop:
            return
        ds = self.build_dataset(start, stop)
        for block in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2):
            yield from _unblock(block)

    # ------------------------------------------------------------------ validation, shares

    def validation_batches(self, source: str, n: int) -> list[Batch]:
        """This rank's micro batches of the first `n` validation global batches of
        `source` (its held-out documents, never trained on). The evaluated rows do
        not depend on the number of ranks. Rows past the end of a small validation
        set are padding (labels -100): weight losses by the number of labels."""
        first = self.rank * self.rows_per_rank
        g = self.spec.global_batch_size
        out: list[Batch] = []
        for k in range(n):
            packed = self.stream.validation_rows(
                source, k * g + first, k * g + first + self.rows_per_rank
            )
            out.extend(split_micro_batches(packed.batch, self.spec.micro_batch_size))
        return out

    def delivered_shares(self, step: int) -> dict[str, float]:
        """Token share per source over global steps [0, step), all ranks together."""
        rows = self._schedule.counts_at(step * self.spec.global_batch_size)
        total = int(rows.sum())
        if total == 0:
            return dict(zip(self.spec.sources, self.spec.weights, strict=True))
        return {n: int(r) / total for n, r in zip(self.spec.sources, rows, strict=True)}

    # ------------------------------------------------------------------ state

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """`step`: the next step to train. Defaults to the step after the last one this
        loader delivered; a consumer that prefetches should pass its own."""
        return {
            "step": self._next_step if step is None else int(step),
            "fingerprint": self.spec.fingerprint,
            "stream": self.spec.stream_identity(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state["step"]`. A different dataset fingerprint is a UserError
        unless data.allow_fingerprint_change; other stream changes are logged."""
        check_resume(self.spec, state)
        self._next_step = int(state["step"])


def check_resume(spec: DataSpec, state: dict[str, Any]) -> None:
    """Refuse to resume on a different prepared dataset unless allowed."""
    if "step" not in state or "fingerprint" not in state:
        raise UserError(
            "data loader state: missing 'step' or 'fingerprint' (not a trainlab checkpoint?)"
        )
    old = state["fingerprint"]
    if old != spec.fingerprint:
        if not spec.allow_fingerprint_change:
            raise UserError(
                f"data.path = {spec.path}: prepared dataset fingerprint {spec.fingerprint[:16]} "
                f"differs from the checkpoint's {str(old)[:16]}; the data changed since the "
                "run started. Set data.allow_fingerprint_change=true to resume anyway"
            )
        log.warning(
            "resuming on a different prepared dataset (fingerprint %s -> %s) because "
            "data.allow_fingerprint_change is set",
            str(old)[:16],
            spec.fingerprint[:16],
        )
    previous = state.get("stream") or {}
    changed = sorted(
        k
        for k, v in spec.stream_identity().items()
        if k != "fingerprint" and k in previous and previous[k] != v
    )
    if changed:
        log.warning(
            "resuming with a changed data stream (%s): steps from %s on follow the new "
            "schedule, so some sequences may repeat or be skipped",
            ", ".join(changed),
            state["step"],
        )
