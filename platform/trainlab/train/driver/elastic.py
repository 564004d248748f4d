"""Elastic runs on Ray Train (`resource.num_workers: {min, max}`; docs/elastic.md).

Ray Train V2 does the mechanics: `ScalingConfig(num_workers=(min, max))` starts the
worker group with what the cluster can place, restarts it smaller after a lost
worker and, every `elastic_resize_monitor_interval_s` while healthy, restarts it
larger when capacity returned. Each restart is a new worker group that resumes
from the newest valid checkpoint (trainlab.train.loop.checkpointer reshards it to
the new size; the data of a step does not depend on dp).

What Ray's elastic policy does not know is trainlab's layout: it may pick any
count between min and max, while a run with tensor or pipeline parallelism may
only run on whole tp x pp groups. `LayoutScalingPolicy` rounds every count it
decides on down to a multiple of tp x pp (`unit`), and `ElasticTorchTrainer`
hands that policy to Ray Train's controller in place of the default one.

What else it does that Ray's policy does not:

- **A lost node is not counted.** Right after a node is lost, the cluster's
  resource view still holds it until the GCS health check marks it dead (about
  15 s with Ray's defaults); a restart sized on that view waits for workers that
  cannot start until Ray's worker-group start timeout (60 s), then starts again.
  So a restart decision waits while a node the view counts does not answer on
  its raylet's port (at most `LOST_NODE_WAIT_S`), then sizes on the live nodes.
- **Growth at a checkpoint taken for it.** When Ray's resize check finds room to
  grow, the policy asks the run for a checkpoint (trainlab.train.loop.growth)
  and restarts the group larger only once the ranks hold at it: no step is redone.
  Its resize check sizes on a fresh view of the nodes (Ray's coordinator
  refreshes its own every 20 s, which delayed a growth by up to that much).
- **Below min after a loss, the attempt fails.** Ray's policy waits for ever while
  fewer than min workers can be placed (and a start that times out is retried
  for ever: a controller failure, not counted by train.max_failures). After a
  loss this one waits `resource.below_min_wait_s`, then fails the attempt
  (`TooFewWorkers`), so `resource.job_retries` applies. The first start waits
  as Ray's does: an autoscaler may be adding the nodes.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.scaling_policy import (
    ElasticScalingPolicy,
    NoopDecision,
    ResizeDecision,
)

from trainlab.run.records import GrowthState

# In Ray Train's controller: beside its own lines (its console and log file).
log = logging.getLogger("ray.train.trainlab")

LOST_NODE_WAIT_S = 60.0  # the longest a restart waits for the GCS to drop a lost node
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 1.0
BELOW_MIN_WAIT_S = 60.0  # resource.below_min_wait_s's default
COORDINATOR_TIMEOUT_S = 5.0  # as Ray's policy waits for the coordinator's answer
GROWTH_WAIT_S = 180.0  # the longest the policy waits for rank 0 to take up its request
# ... and, once taken up, for the held checkpoint to be committed (a large model's
# checkpoint to a store can take minutes: cancelling it would waste it, and the next
# resize check would ask for another)
GROWTH_SAVE_WAIT_S = 3600.0


def whole_groups(count: int, unit: int, lo: int, hi: int) -> int:
    """The largest multiple of `unit` within [0, min(count, hi)]; 0 when that is
    below `lo` (Ray then waits, or gives up: fewer workers than allowed)."""
    n = (min(count, hi) // unit) * unit
    return n if n >= lo else 0


def raylet_answers(address: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a node's raylet accepts a TCP connection (a killed raylet refuses
    at once; a vanished machine times out)."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def live_nodes(nodes: list[dict[str, Any]], answers: Any = raylet_answers) -> tuple[set, set]:
    """(node ids the GCS reports alive whose raylet answers, those alive whose
    raylet does not) from `ray.nodes()` entries."""
    live, silent = set(), set()
    for n in nodes:
        if not n.get("Alive"):
            continue
        ok = answers(n.get("NodeManagerAddress", ""), int(n.get("NodeManagerPort") or 0))
        (live if ok else silent).add(n["NodeID"])
    return live, silent


class TooFewWorkers(RuntimeError):
    """A restart of an elastic run found fewer than min workers for too long."""


class LayoutScalingPolicy(ElasticScalingPolicy):
    """Ray Train's elastic policy, deciding only sizes that keep tensor and pipeline
    groups whole (multiples of `unit` = tp x pp), on nodes whose raylet answers,
    and growing at a checkpoint taken for it (`run_dir` given)."""

    def __init__(
        self,
        scaling_config: Any,
        unit: int,
        run_dir: str | None = None,
        below_min_wait_s: float = BELOW_MIN_WAIT_S,
    ):
        super().__init__(scaling_config)
        self.unit = unit
        self.run_dir = run_dir
        self.below_min_wait_s = below_min_wait_s
        self._ran = False  # a worker group of this run has run (a restart is not the start)
        self._records: Any = None
        self._probed_at = float("-inf")
        self._live: set[str] | None = None
        self._silent: set[str] = set()
        self._silent_since: float | None = None
        self._short_since: float | None = None
        self._growth: tuple[ResizeDecision, str, float] | None = None
        self._fresh_view = False

    # ----------------------------------------------------------- lost nodes

    def _probe(self) -> None:
        import ray

        now = time.monotonic()
        if now - self._probed_at < PROBE_EVERY_S:
            return
        self._probed_at = now
        try:
            self._live, self._silent = live_nodes(ray.nodes())
        except Exception:  # noqa: BLE001 - the GCS busy: size as Ray would
            self._live, self._silent = None, set()

    def _count_possible_workers(self, reserved_resources: Any) -> int:
        self._probe()  # only when Ray sizes the group, not at every poll of it
        if self._live is not None:
            reserved_resources = {
                node: r for node, r in reserved_resources.items() if node in self._live
            }
        count = super()._count_possible_workers(reserved_resources)
        sc = self.scaling_config
        return whole_groups(count, self.unit, sc.min_workers, sc.max_workers)

    def make_decision_for_non_running_worker_group(self) -> Any:
        """A (re)start: sized on the nodes that answer, once the GCS has dropped
        the ones that do not (or LOST_NODE_WAIT_S passed)."""
        self._growth = None  # a new group: the old one's request is void
        self._probe()
        if self._silent:
            now = time.monotonic()
            if self._silent_since is None:
                self._silent_since = now
                log.info(
                    "node(s) %s do not answer: restarting once Ray drops them",
                    ", ".join(sorted(n[:8] for n in self._silent)),
                )
            if now - self._silent_since < LOST_NODE_WAIT_S:
                return NoopDecision()
        else:
            self._silent_since = None
        decision = super().make_decision_for_non_running_worker_group()
        if isinstance(decision, ResizeDecision):
            self._short_since = None
            return decision
        # Fewer workers than min can be placed. At the first start Ray's policy waits
        # (an autoscaler may be adding nodes); after a loss, `below_min_wait_s` on,
        # the attempt fails (resource.job_retries then applies), as the loss of a
        # fixed-size run's node does.
        if not self._ran:
            return decision
        now = time.monotonic()
        if self._short_since is None:
            self._short_since = now
        if now - self._short_since < self.below_min_wait_s:
            return decision
        raise TooFewWorkers(
            f"fewer than resource.num_workers.min = {self.scaling_config.min_workers} "
            f"workers could be placed for {self.below_min_wait_s:.0f} s after a loss "
            f"(resource.below_min_wait_s)"
        )

    # ----------------------------------------------------------- growth

    def _run_records(self) -> Any:
        if self._records is None and self.run_dir is not None:
            from trainlab.run.records import RunRecords

            self._records = RunRecords(self.run_dir)
        return self._records

    def make_decision_for_running_worker_group(
        self, worker_group_state: Any, worker_group_status: Any
    ) -> Any:
        """Ray's resize check; a growth it decides waits for the run's checkpoint."""
        self._ran = True
        if self._growth is not None:
            self._maybe_send_resource_request()  # keeps the reservation alive meanwhile
            return self._growth_decision()
        self._fresh_view = True
        try:
            decision = super().make_decision_for_running_worker_group(
                worker_group_state, worker_group_status
            )
        finally:
            self._fresh_view = False
        records = self._run_records()
        grows = (
            isinstance(decision, ResizeDecision)
            and decision.num_workers > worker_group_state.num_workers
        )
        if not grows or records is None:
            return decision
        try:
            request_id = records.request_growth(decision.num_workers)
        except Exception as e:  # noqa: BLE001 - the store unreachable: grow as Ray would
            log.warning("could not ask the run for a checkpoint to grow at (%s)", e)
            return decision
        log.info(
            "room for %d workers: asked the run for a checkpoint to grow at",
            decision.num_workers,
        )
        self._growth = (decision, request_id, time.monotonic())
        return NoopDecision()

    def _get_reserved_resources(self) -> Any:
        """At a resize check, the reservation on a fresh view of the nodes. Ray's
        autoscaling coordinator otherwise refreshes its node list every 20 s
        (its tick), so a node that joined was seen up to 20 s late; a resize check
        comes once per `resource.resize_check_s`, so the refresh costs little."""
        if not self._fresh_view:
            return super()._get_reserved_resources()
        import ray

        try:
            reserved = ray.get(
                self._autoscaling_coordinator.get_reserved_resources.remote(
                    self._requester_id, recompute=True
                ),
                timeout=COORDINATOR_TIMEOUT_S,
            )
        except Exception as e:  # noqa: BLE001 - the coordinator busy: Ray's own answer
            log.debug("no fresh reservation (%s): using the coordinator's last", e)
            return super()._get_reserved_resources()
        self._latest_reserved_resources = reserved
        return reserved

    def _growth_decision(self) -> Any:
        decision, request_id, since = self._growth  # type: ignore[misc]
        records = self._run_records()
        record = records.growth()
        if record is not None and record.id == request_id:
            if record.state is GrowthState.READY:
                records.growth_go(request_id)
                self._growth = None
                log.info(
                    "the run holds at the checkpoint of step %s: restarting at %d workers",
                    record.step,
                    decision.num_workers,
                )
                return decision
            limit = GROWTH_SAVE_WAIT_S if record.state is GrowthState.ACCEPTED else GROWTH_WAIT_S
            if time.monotonic() - since < limit:
                return NoopDecision()
        records.cancel_growth()  # gone, replaced, or not taken in time: no growth now
        self._growth = None
        return NoopDecision()


class ElasticTorchTrainer(TorchTrainer):
    """A TorchTrainer whose controller scales by `LayoutScalingPolicy`. Ray Train's
    own `fit` builds the default policy from the scaling config; this one differs
    only in the policy it hands the controller."""

    def __init__(
        self,
        *args: Any,
        unit: int = 1,
        run_dir: str | None = None,
        below_min_wait_s: float = BELOW_MIN_WAIT_S,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self._unit = unit
        self._run_dir = run_dir
        self._below_min_wait_s = below_min_wait_s

    def fit(self) -> Any:
        from ray.train.v2._internal.execution.failure_handling import create_failure_policy
        from ray.train.v2._internal.util import ObjectRefWrapper

        result = self._initialize_and_run_controller(
            train_fn_ref=ObjectRefWrapper(self._get_train_func()),
            scaling_policy=LayoutScalingPolicy(
                self.scaling_config, self._unit, self._run_dir, self._below_min_wait_s
            ),
            failure_policy=create_failure_policy(self.run_config.failure_config),
            train_run_context=self.train_run_context,
            callbacks=self._create_default_callbacks(),
            validation_config=self.validation_config,
        )
        if result.error:
            raise result.error
        return result
