"""Where the stages run: a Ray Data pipeline, or this process.

`map_items` runs a stage (`stages`) over small work items and yields its small
summary tables, in any order. It counts what reaches this process
(`received`): `document_bytes` are the bytes of any document data (text or
token columns) among them, which the stages never send (0; `make bench` and the
tests check it). The local executor runs the very same functions without Ray;
it serves tiny inputs and tests.

A stage of real work can also be *pulled* (`blocks="pull"`): one long task per
worker walks the items heaviest first and claims each one (an exclusive file
create) before running it, so no worker waits between items for the scheduler
and the stage ends within one item of its last worker.

It also keeps where the workers' time went (`Received.busy`): each stage's
summary rows carry the wall seconds the worker spent on them and which worker
(process) it was, so the driver can tell busy workers from idle ones without
receiving anything else.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
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
    # Per stage: (worker, start, end) of every batch a worker ran (wall clock, s).
    busy: dict[str, list[tuple[str, float, float]]] = field(default_factory=dict)

    def count(self, stage: str, table: pa.Table) -> pa.Table:
        self.tables += 1
        self.bytes += table.nbytes
        self.by_stage[stage] = self.by_stage.get(stage, 0) + table.nbytes
        self.document_bytes += sum(
            table.column(c).nbytes for c in DOCUMENT_COLUMNS if c in table.column_names
        )
        if BUSY_COLUMN in table.column_names:
            spans = self.busy.setdefault(stage, [])
            for cell in table.column(BUSY_COLUMN).to_pylist():
                if cell:
                    spans.append(tuple(json.loads(cell)))
            table = table.drop_columns([BUSY_COLUMN])
        return table

    def utilisation(self, stage: str, start: float, end: float, workers: int) -> dict[str, float]:
        """How busy a stage (from `start` to `end`, wall clock) kept its `workers`:
        `busy_s` (their summed time on batches), `busy_share` (of workers x wall),
        `first_s` (until the first batch started: scheduling, worker start-up) and
        `tail_idle_s` (worker time idle after its last batch, before the end)."""
        spans = [s for s in self.busy.get(stage, []) if start <= s[1] <= end]
        wall = end - start
        if not spans or wall <= 0:
            return {"busy_s": 0.0, "busy_share": 0.0, "first_s": 0.0, "tail_idle_s": 0.0}
        busy = sum(e - s for _, s, e in spans)
        last: dict[str, float] = {}
        for worker, _, e in spans:
            last[worker] = max(last.get(worker, e), e)
        tail = sum(end - t for t in last.values()) + max(0, workers - len(last)) * wall
        return {
            "busy_s": busy,
            "busy_share": busy / (workers * wall),
            "first_s": min(s for _, s, _ in spans) - start,
            "tail_idle_s": tail,
        }


BUSY_COLUMN = "_busy"


def items_table(items: list[dict[str, Any]]) -> pa.Table:
    """One batch: a single row holding its items (a JSON list)."""
    return pa.table({"item": pa.array([json.dumps(items)], pa.string())})


def guided_blocks(items: list[dict[str, Any]], workers: int) -> list[list[dict[str, Any]]]:
    """Items grouped into batches for `workers` workers that pull the next batch as
    they finish one: heaviest items first (item key "weight", default 1), each batch
    about half the remaining weight per worker (guided self-scheduling). Few big
    batches early keep scheduling gaps few; small ones at the end keep every worker
    busy until the stage ends instead of one finishing a big batch alone."""
    order = sorted(items, key=lambda i: -float(i.get("weight", 1)))
    remaining = sum(float(i.get("weight", 1)) for i in order)
    blocks: list[list[dict[str, Any]]] = []
    block: list[dict[str, Any]] = []
    weight = 0.0
    for item in order:
        block.append(item)
        weight += float(item.get("weight", 1))
        if weight >= remaining / (2 * max(1, workers)):
            blocks.append(block)
            remaining -= weight
            block, weight = [], 0.0
    if block:
        blocks.append(block)
    return blocks


def even_blocks(items: list[dict[str, Any]], workers: int) -> list[list[dict[str, Any]]]:
    """Items, in their order, cut into at most `workers` runs of about equal weight:
    one task per worker, for stages whose items are too cheap to be worth a task
    each (and whose neighbouring items share reads, as a source's units do)."""
    n = max(1, min(workers, len(items)))
    weights = [float(i.get("weight", 1)) for i in items]
    total = sum(weights) or 1.0
    blocks: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    done = 0.0
    for item, w in zip(items, weights, strict=True):
        blocks[min(n - 1, int((done + w / 2) / total * n))].append(item)
        done += w
    return [b for b in blocks if b]


def timed(stage: Callable) -> Callable:
    """`stage` as a Ray Data batch function whose output's first row carries the
    worker ("node:pid") and its wall-clock start and end in `BUSY_COLUMN` (read
    and dropped by `Received`)."""

    def run(batch: pa.Table, **kwargs: Any) -> pa.Table:
        from trainlab.raycluster import normal_priority

        normal_priority()  # prep is the node's work, as training is (not Ray's nice 15)
        start = time.time()
        return _with_span(stage(batch, **kwargs), start)

    run.__name__ = _stage_name(stage)
    return run


def _with_span(out: pa.Table, start: float) -> pa.Table:
    span = json.dumps([f"{_node_short()}:{os.getpid()}", start, time.time()])
    cells = [span] + [None] * (out.num_rows - 1) if out.num_rows else []
    return out.append_column(BUSY_COLUMN, pa.array(cells, pa.string()))


PULL_COLUMN = "_item"  # which item a pulled output row answers (read and dropped)


def pulled(stage: Callable) -> Callable:
    """`stage` as the body of a pull task (`blocks="pull"`): walk the listed items
    (`listing`: [position, item] pairs, heaviest first), claim each one by creating
    `claims/<position>` exclusively, run the stage on it, and yield its output at
    once, tagged with the position. Every task walks the same list, so the items
    spread over the workers as they free up. An item whose claimer died unreported
    is redone by the driver (`RayDataExecutor.map_items`)."""

    def run(batch: pa.Table, listing: ByRef, claims: str, **kwargs: Any) -> Iterator[pa.Table]:
        from trainlab.raycluster import normal_priority

        normal_priority()
        del batch  # one row per task, naming nothing: the work is in `listing`
        for position, item in json.loads(listing.get()):  # type: ignore[arg-type]
            if not _claim(os.path.join(claims, str(position))):
                continue
            start = time.time()
            out = _with_span(stage(items_table([item]), **kwargs), start)
            yield out.append_column(PULL_COLUMN, pa.array([position] * out.num_rows, pa.int64()))

    run.__name__ = _stage_name(stage)
    return run


def _claim(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def _node_short() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()[:12] if ray.is_initialized() else "local"


def _stage_name(stage: Callable) -> str:
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
        stage: Callable,
        kwargs: dict[str, Any],
        blocks: str = "guided",
        scratch: str | None = None,
    ) -> Iterable[pa.Table]:
        """`stage(batch, **kwargs)` per item. `blocks` and `scratch` are ignored: one
        item at a time."""
        for item in items:
            start = time.time()
            out = stage(items_table([item]), **kwargs)
            self.received.busy.setdefault(_stage_name(stage), []).append(
                ("local", start, time.time())
            )
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

    def __init__(self, this_node_only: bool = False) -> None:
        """`this_node_only`: every worker on this process's node (a dataset staged in
        this node's scratch before an upload to object storage: other nodes do not
        see that directory)."""
        import ray

        from trainlab.raycluster import ensure_ray

        resources = ensure_ray()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        # SPREAD (here and for the stages' tasks): over every node of a cluster, not
        # packed onto the driver's node first (Ray's default does that until half of
        # its CPUs are busy, so a small prep ran on one node); one node: no change.
        self._strategy: Any = "SPREAD"
        if this_node_only and len(nodes) > 1:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = ray.get_runtime_context().get_node_id()
            nodes = [n for n in nodes if n["NodeID"] == here]
            resources = dict(nodes[0].get("Resources") or {}) if nodes else resources
            self._strategy = NodeAffinitySchedulingStrategy(here, soft=False)
        # One node is this machine (the embedded cluster advertises more logical CPUs
        # than it has cores); on a real cluster the logical CPUs are the cores.
        physical = (os.cpu_count() or 1) if len(nodes) <= 1 else int(resources.get("CPU", 1))
        self.plan = plan_ray_resources(resources.get("CPU", 1), physical)
        self.parallelism = self.plan.stage_actors
        self.tokenizer_threads = self.plan.tokenizer_threads
        self.received = Received()
        # The workers start (and import what every stage needs) while this process
        # imports Ray Data and plans the work, not after.
        warm = ray.remote(num_cpus=1, scheduling_strategy=self._strategy)(_warm_up)
        self._warming = [warm.remote() for _ in range(self.plan.stage_actors)]
        _quiet_ray_data_console()
        log.info("prep resources: %s", self.plan)

    def map_items(
        self,
        items: list[dict[str, Any]],
        stage: Callable,
        kwargs: dict[str, Any],
        blocks: str = "guided",
        scratch: str | None = None,
    ) -> Iterator[pa.Table]:
        """`stage(batch, **kwargs)` in at most `stage_actors` concurrent tasks.
        Results stream back as they finish; what the workers write goes straight
        to storage.

        The items are cut into batches, a task each: `blocks="guided"`
        (`guided_blocks`) for items of real work, `"even"` (`even_blocks`: one
        batch per worker) for cheap ones. Ray Data notices a finished task only at
        its next 0.1 s poll, so every batch boundary leaves its worker idle ~0.15 s;
        `"pull"` (`pulled`) avoids them: one task per worker, claiming items under
        `scratch` (a directory every worker can write: the output directory)."""
        import ray

        if not items:
            return
        if self._warming:
            ray.get(self._warming)  # else Ray would start more workers beside them
            self._warming = []
        if blocks == "pull":
            if scratch is None:
                raise ValueError("blocks='pull' needs a scratch directory for its claims")
            yield from self._pull(items, stage, kwargs, scratch)
            return
        workers = self.plan.stage_actors
        batches = even_blocks(items, workers) if blocks == "even" else guided_blocks(items, workers)
        ds = self._dataset([json.dumps(b) for b in batches])
        kwargs = _by_ref(kwargs)
        workers = min(workers, len(batches))
        ds = self._map(ds, timed(stage), kwargs, workers, self._strategy)
        for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            yield self.received.count(_stage_name(stage), table)

    def _pull(
        self, items: list[dict[str, Any]], stage: Callable, kwargs: dict[str, Any], scratch: str
    ) -> Iterator[pa.Table]:
        import ray

        order = sorted(range(len(items)), key=lambda i: -float(items[i].get("weight", 1)))
        listing = ByRef(ray.put(json.dumps([[i, items[i]] for i in order])))
        claims = tempfile.mkdtemp(prefix=f"claims-{_stage_name(stage)}-", dir=scratch)
        workers = min(self.plan.stage_actors, len(items))
        ds = self._dataset([str(j) for j in range(workers)])
        # Each item's output leaves its task as its own block, at once (Ray Data would
        # otherwise gather a task's outputs up to its block size first).
        ds.context.target_max_block_size = 1
        ds = self._map(
            ds,
            pulled(stage),
            {**_by_ref(kwargs), "listing": listing, "claims": claims},
            workers,
            self._strategy,
        )
        reported: set[int] = set()
        try:
            for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                reported.update(table.column(PULL_COLUMN).to_pylist())
                yield self.received.count(_stage_name(stage), table.drop_columns([PULL_COLUMN]))
        finally:
            shutil.rmtree(claims, ignore_errors=True)
        lost = [items[i] for i in range(len(items)) if i not in reported]
        if lost:
            # A task that died (its worker or node lost) left claimed items unreported;
            # a retried task skips them. Their results, written atomically, may exist:
            # redoing an item gives the same bytes.
            log.warning("%d item(s) of %s unreported: running them again", len(lost), stage)
            yield from self.map_items(lost, stage, kwargs, blocks="guided")

    def _dataset(self, batches: list[str]) -> Any:
        import ray.data

        ds = ray.data.from_items([{"item": b} for b in batches], override_num_blocks=len(batches))
        ds.context.execution_options.preserve_order = False
        ds.context.enable_progress_bars = False
        _task_slots_only(ds.context)
        return ds

    @staticmethod
    def _map(ds: Any, fn: Callable, kwargs: dict[str, Any], workers: int, strategy: Any) -> Any:
        """`fn` (`timed`, `pulled`) over the dataset's batches, `workers` tasks at most."""
        import warnings

        import ray.data

        with warnings.catch_warnings():
            # Ray 2.60 deprecates passing remote args by keyword in favour of named
            # parameters, but has none for a scheduling strategy (SPREAD over the
            # nodes, or this node only): the keyword is still the way.
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            return ds.map_batches(
                fn,
                fn_kwargs=kwargs,
                batch_size=None,
                batch_format="pyarrow",
                num_cpus=1,
                compute=ray.data.TaskPoolStrategy(size=workers),
                scheduling_strategy=strategy,
            )


def _warm_up() -> int:
    """Run once in each worker as the prep starts: what every stage's task imports."""
    from trainlab.raycluster import normal_priority

    normal_priority()
    import ray.data  # noqa: F401 - Ray Data's task code (~1.5 s)
    import tokenizers  # noqa: F401

    import trainlab.data.prep.stages  # noqa: F401

    return os.getpid()


def _task_slots_only(context: Any) -> None:
    """Let a stage run `stage_actors` tasks at once from its start. Ray Data's
    object-store budget (its ResourceBudget backpressure policy) admits one task
    at a time until it has seen outputs; every stage here is a new dataset whose
    outputs are summary rows of a few hundred bytes, so that policy held each of
    the cheap stages to one task at a time and started the second unit task only
    once the first ended (measured on 2 cores: two tasks of 0.9 s took 1.9 s
    instead of 1.0 s; the quarter bench corpus's dedup, settle and write stages
    1.0, 1.3, 1.5 s instead of 0.6, 0.8, 1.0 s). Ray Data's other policies stay,
    including the one that caps the tasks at the pool size."""
    from ray.data._internal.execution import backpressure_policy as bp

    policies = [
        p for p in bp.ENABLED_BACKPRESSURE_POLICIES if p is not bp.ResourceBudgetBackpressurePolicy
    ]
    context.set_config(bp.ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY, policies)


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
