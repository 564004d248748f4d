"""Where a job retry places its training workers: away from the nodes blamed
for the previous attempt's failure (trainlab.rayjobs.retry re-runs the trainer).

The trainer, once Ray Train gave up, names the nodes where its workers died
or that the cluster declared dead under them (`lost_nodes`, into run_summary.json); the retry wrapper passes every node
blamed so far to the re-run in TRAINLAB_EXCLUDE_NODES, and the launcher turns
that into Ray Train's `ScalingConfig.label_selector` (`node_selector`) on the
label every Ray node carries, `ray.io/node-id`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

EXCLUDE_ENV = "TRAINLAB_EXCLUDE_NODES"  # comma-separated Ray node ids
NODE_LABEL = "ray.io/node-id"  # a label every Ray node carries
# How an actor death reads when the process or its node failed (Ray's
# ActorDiedErrorContext.Reason), as opposed to Ray Train stopping its workers.
BLAMED_REASONS = frozenset({"WORKER_DIED", "NODE_DIED"})
TRAIN_WORKER_CLASS = "RayTrainWorker"


def excluded_nodes(environ: dict[str, str] | None = None) -> list[str]:
    """The node ids a re-run must avoid (TRAINLAB_EXCLUDE_NODES), sorted."""
    raw = (os.environ if environ is None else environ).get(EXCLUDE_ENV, "")
    return sorted({n.strip() for n in raw.split(",") if n.strip()})


def node_selector(environ: dict[str, str] | None = None) -> dict[str, str] | None:
    """Ray Train's `ScalingConfig.label_selector` keeping every worker off the
    excluded nodes; None when none are excluded."""
    nodes = excluded_nodes(environ)
    return {NODE_LABEL: f"!in({','.join(nodes)})"} if nodes else None


def lost_nodes(
    error: BaseException | None = None, timeout_s: float = 60.0, poll_s: float = 1.0
) -> list[str]:
    """Node ids where this driver's Ray Train workers died because their process or
    their node failed, from Ray's GCS; called after Ray Train gave up with `error`.

    A worker's own death cause names a crashed process (WORKER_DIED, OOM) at once.
    A lost node does not show in it: Ray Train's controller sees the worker's health
    check fail and kills the whole group (`ray.kill`, recorded as the cause) before
    the GCS declares the node dead (its own health checks, tens of seconds). So a
    worker's node that the GCS has declared dead is blamed too, waiting up to
    `timeout_s` for that. A failure that was no health-check failure (a worker
    raised) blames nothing and waits for nothing. Uses `ray._private.state.actors`
    and `ray.nodes()`: the GCS through the connected driver, no address or token."""
    import ray
    from ray._private.state import actors

    if error is not None and not _health_check_failed(error):
        return []
    try:
        job = ray.get_runtime_context().get_job_id()
        deadline = time.monotonic() + timeout_s
        while True:
            mine = [
                a
                for a in actors().values()
                if a.get("ActorClassName") == TRAIN_WORKER_CLASS and a.get("JobID") == job
            ]
            dead = {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
            blamed = {
                a["Address"]["NodeID"]
                for a in mine
                if a.get("State") == "DEAD" and (_blamed(a) or a["Address"]["NodeID"] in dead)
            }
            if blamed or time.monotonic() > deadline:
                return sorted(blamed)
            time.sleep(poll_s)
    except Exception:  # noqa: BLE001 - blame is a hint for the retry; the failure stands
        log.exception("could not tell on which nodes the training workers died")
        return []


def _health_check_failed(error: BaseException) -> bool:
    """Whether Ray Train gave up because a worker stopped answering (its process or
    node died), not because a worker raised. Errors without per-worker failures
    (the controller's own) count as possibly lost nodes."""
    failures = getattr(error, "worker_failures", None)
    if not failures:
        return True
    from ray.exceptions import RayActorError

    return any(
        isinstance(e, RayActorError) or type(e).__name__.startswith("WorkerHealthCheck")
        for e in failures.values()
    )


def _blamed(actor: dict[str, Any]) -> bool:
    """Whether an actor-table entry is a worker whose process or node failed."""
    if actor.get("State") != "DEAD":
        return False
    cause = actor.get("DeathCause")
    if cause is None:
        return False
    if cause.HasField("oom_context"):
        return True
    if not cause.HasField("actor_died_error_context"):
        return False
    ctx = cause.actor_died_error_context
    return type(ctx).Reason.Name(ctx.reason) in BLAMED_REASONS
