"""Where the stages run: a Ray Data pipeline, or this process.

`map_items` runs a stage (`stages`) over small work items and yields its small
summary tables, in any order. It counts what reaches this process
(`received`): `document_bytes` are the bytes of any document data (text or
token columns) among them, which the stages never send (0; `make bench` and the
tests check it). The local executor runs the very same functions without Ray;
it serves tiny inputs and tests.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from trainlab.data.prep.units import ByRef

log = logging.getLogger(__name__)

# Columns that hold document data; anything else the driver receives is metadata.
DOCUMENT_COLUMNS = ("text", "tokens")


@dataclass
class Received:
    """What the executor handed to this process."""

    tables: int = 0
    bytes: int = 0
    document_bytes: int = 0
    by_stage: dict[str, int] = field(default_factory=dict)

    def count(self, stage: str, table: pa.Table) -> pa.Table:
        self.tables += 1
        self.bytes += table.nbytes
        self.by_stage[stage] = self.by_stage.get(stage, 0) + table.nbytes
        self.document_bytes += sum(
            table.column(c).nbytes for c in DOCUMENT_COLUMNS if c in table.column_names
        )
        return table


def items_table(items: list[dict[str, Any]]) -> pa.Table:
    return pa.table({"item": pa.array([json.dumps(i) for i in items], pa.string())})


def _stage_name(stage: type | Callable) -> str:
    return getattr(stage, "__name__", type(stage).__name__)


class LocalExecutor:
    """Every work item in this process, one after the other."""

    parallelism = 1
    tokenizer_threads = True

    @property
    def received(self) -> Received:
        if "_received" not in self.__dict__:
            self._received = Received()
        return self._received

    def map_items(
        self,
        items: list[dict[str, Any]],
        stage: type | Callable,
        kwargs: dict[str, Any],
    ) -> Iterable[pa.Table]:
        """`stage`: a class (built once with `kwargs`, called per batch) or a function
        (called as `stage(batch, **kwargs)`)."""
        fn = stage(**kwargs) if isinstance(stage, type) else None
        for item in items:
            batch = items_table([item])
            out = fn(batch) if fn is not None else stage(batch, **kwargs)
            yield self.received.count(_stage_name(stage), out)


@dataclass(frozen=True)
class RayPlan:
    """CPUs a stage may hold: one worker (a 1-CPU task, or actor) per real core, and
    never every logical CPU of the cluster, so other operators (and a training run
    beside it) are not starved (see docs/ray-resources.md). Each unit task reads,
    cleans, hashes, tokenizes and writes its units in one process."""

    stage_actors: int
    # Tokenizer threads inside a worker only help when workers leave cores idle.
    tokenizer_threads: bool


def plan_ray_resources(cluster_cpus: float, physical_cpus: int) -> RayPlan:
    logical = max(1, int(cluster_cpus))
    actors = max(1, min(physical_cpus, logical - 1))
    return RayPlan(actors, tokenizer_threads=actors < physical_cpus)


class RayDataExecutor:
    """Each stage: one Ray Data dataset of work items mapped by capped workers."""

    def __init__(self) -> None:
        import ray

        from trainlab.raycluster import ensure_ray

        resources = ensure_ray()
        _quiet_ray_data_console()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        # One node is this machine (the embedded cluster advertises more logical CPUs
        # than it has cores); on a real cluster the logical CPUs are the cores.
        physical = (os.cpu_count() or 1) if len(nodes) <= 1 else int(resources.get("CPU", 1))
        self.plan = plan_ray_resources(resources.get("CPU", 1), physical)
        self.parallelism = self.plan.stage_actors
        self.tokenizer_threads = self.plan.tokenizer_threads
        self.received = Received()
        log.info("prep resources: %s", self.plan)

    def map_items(
        self,
        items: list[dict[str, Any]],
        stage: type | Callable,
        kwargs: dict[str, Any],
    ) -> Iterator[pa.Table]:
        """A class runs in a fixed pool of actors (built once each), a function in
        at most `stage_actors` concurrent tasks. Results stream back as they
        finish; what the workers write goes straight to storage."""
        import ray.data

        if not items:
            return
        # A few items per block: enough blocks to balance the workers, few enough
        # that per-task overhead stays small next to the work.
        ds = ray.data.from_items(
            [{"item": json.dumps(i)} for i in items],
            override_num_blocks=min(len(items), 4 * self.plan.stage_actors),
        )
        ds.context.execution_options.preserve_order = False
        ds.context.enable_progress_bars = False
        kwargs = _by_ref(kwargs)
        if isinstance(stage, type):
            ds = ds.map_batches(
                stage,
                fn_constructor_kwargs=kwargs,
                batch_size=None,
                batch_format="pyarrow",
                num_cpus=1,
                compute=ray.data.ActorPoolStrategy(size=min(self.plan.stage_actors, len(items))),
            )
        else:
            ds = ds.map_batches(
                stage,
                fn_kwargs=kwargs,
                batch_size=None,
                batch_format="pyarrow",
                num_cpus=1,
                compute=ray.data.TaskPoolStrategy(size=min(self.plan.stage_actors, len(items))),
            )
        for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            yield self.received.count(_stage_name(stage), table)


def _by_ref(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Big arguments (the tokenizer JSON) go through the object store by reference."""
    import ray

    return {
        k: ByRef(ray.put(v)) if isinstance(v, str | bytes) and len(v) > 50_000 else v
        for k, v in kwargs.items()
    }


class _WarningsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and not record.getMessage().startswith(
            "Progress bars disabled"
        )


def _quiet_ray_data_console() -> None:
    """Ray Data logs every dataset's start and plan to the console, and warns that its
    own progress bars are off; prep reports progress itself. Its warnings and errors
    still reach the console, and its log files keep everything."""
    import ray.data  # noqa: F401 - configures the "ray.data" logger and its handlers

    for handler in logging.getLogger("ray.data").handlers:
        if type(handler).__name__ == "PlainRayHandler" and not any(
            isinstance(f, _WarningsOnly) for f in handler.filters
        ):
            handler.addFilter(_WarningsOnly())
