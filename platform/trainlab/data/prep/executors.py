"""Where the per-unit stages run: a Ray Data pipeline, or this process.

Both yield the stage's output tables in unit order, which is what makes the
writer's "first copy wins" deduplication deterministic. The local executor
runs the very same functions without Ray; it serves tiny inputs and tests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from trainlab.data.prep.units import (
    ByRef,
    WorkUnit,
    read_clean_batch,
    read_clean_unit,
    sample_texts,
)

log = logging.getLogger(__name__)


class SampleStage:
    """The tokenizer-training sample of a unit (see `units.sample_texts`)."""

    def __init__(self, fraction: float):
        self.fraction = fraction

    def __call__(self, table: pa.Table) -> pa.Table:
        sample = sample_texts(table, self.fraction)
        unit = table.column("unit")[0].as_py() if table.num_rows else -1
        return sample.append_column("unit", pa.array([unit] * sample.num_rows, pa.int64()))


class LocalExecutor:
    """Every unit in this process, one after the other."""

    parallelism = 1
    tokenizer_threads = True

    def map_units(
        self, units: list[WorkUnit], stage_cls: type, stage_kwargs: dict[str, Any]
    ) -> Iterator[pa.Table]:
        stage = stage_cls(**stage_kwargs)
        for unit in units:
            yield stage(read_clean_unit(unit))


@dataclass(frozen=True)
class RayPlan:
    """CPUs the stage may hold: one actor per real core, and never every logical CPU
    of the cluster, so other operators (and a training run beside it) are not
    starved (see docs/ray-resources.md). Ray Data fuses the read/clean map into the actors,
    so each actor reads, cleans, hashes and tokenizes its unit in one process."""

    stage_actors: int
    # Tokenizer threads inside an actor only help when actors leave cores idle.
    tokenizer_threads: bool


def plan_ray_resources(cluster_cpus: float, physical_cpus: int) -> RayPlan:
    logical = max(1, int(cluster_cpus))
    actors = max(1, min(physical_cpus, logical - 1))
    return RayPlan(actors, tokenizer_threads=actors < physical_cpus)


class RayDataExecutor:
    """read/clean map tasks -> a fixed actor pool running the stage, order preserved."""

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
        log.info("prep resources: %s", self.plan)

    def map_units(
        self, units: list[WorkUnit], stage_cls: type, stage_kwargs: dict[str, Any]
    ) -> Iterator[pa.Table]:
        import ray.data  # binds `ray` too

        items = [{"unit": u.to_json()} for u in units]
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        ctx = ds.context
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        ds = ds.map_batches(read_clean_batch, batch_size=1, batch_format="pyarrow")
        # Big arguments (the tokenizer JSON) go through the object store by reference.
        kwargs = {
            k: ByRef(ray.put(v)) if isinstance(v, str | bytes) and len(v) > 50_000 else v
            for k, v in stage_kwargs.items()
        }
        ds = ds.map_batches(
            stage_cls,
            fn_constructor_kwargs=kwargs,
            batch_size=None,
            batch_format="pyarrow",
            num_cpus=1,
            compute=ray.data.ActorPoolStrategy(size=self.plan.stage_actors),
        )
        yield from ds.iter_batches(batch_size=None, batch_format="pyarrow")


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
