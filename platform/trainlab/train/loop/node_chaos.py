"""train.chaos.kill_node_at_steps: the rehearsal of a lost node, as kill_at_steps
is of a lost process.

At step k (once per run directory) the training processes agree on a victim: the
lowest rank on a node other than the driver's. That process records the kill and
SIGKILLs its node's raylet (found among its own ancestors: Ray's worker processes
are the raylet's children), then itself: the node is gone with every process of
the run on it, as when a machine dies. Ray Train sees its workers lost; an
elastic run continues on the workers Ray can still place (docs/elastic.md), a
fixed-size one restarts as after any lost node.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from trainlab.run.records import Failure
from trainlab.train.job import NODE_ID_ENV
from trainlab.train.loop.components import Component
from trainlab.train.loop.protocol import Loop

log = logging.getLogger("trainlab.train")


def marker(step: int) -> str:
    """Where the run records that a node was killed at `step` (once per run)."""
    return f"logs/chaos-node-step-{step:08d}.json"


def raylet_ancestor(pid: int | None = None) -> int | None:
    """The pid of the nearest ancestor of `pid` (default: this process) whose
    executable is Ray's `raylet`, or None."""
    pid = os.getpid() if pid is None else pid
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            if Path(os.readlink(f"/proc/{pid}/exe")).name == "raylet":
                return pid
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4: the parent's pid
    return None


def victim_rank(nodes: list[str | None], driver_node: str | None) -> int | None:
    """The lowest rank whose node is known and not the driver's."""
    return next((r for r, n in enumerate(nodes) if n and n != driver_node), None)


class NodeChaos(Component):
    """Kills the raylet of a node hosting a training worker (not the driver's) the
    first time each step of train.chaos.kill_node_at_steps is reached."""

    def after_step(self, loop: Loop, step: int) -> None:
        if step not in loop.cfg.train.chaos.kill_node_at_steps:
            return
        if loop.records.loc.exists(marker(step)):  # checked by every rank before agreeing
            return
        nodes = self._nodes(loop)
        victim = victim_rank(nodes, loop.job.driver_node_id)
        if victim is None:
            if loop.env.is_main:
                log.warning(
                    "chaos: no training worker outside the driver's node at step %d: "
                    "train.chaos.kill_node_at_steps has no node to lose",
                    step,
                )
            return
        if loop.env.rank != victim:
            return
        raylet = raylet_ancestor()
        error = (
            f"chaos: train.chaos.kill_node_at_steps killed node {nodes[victim]} "
            f"(raylet pid {raylet}, rank {victim}) at step {step}"
        )
        record = {"step": step, "rank": victim, "node": nodes[victim], "time": time.time()}
        loop.records.loc.write_text(marker(step), json.dumps(record))
        loop.records.add_failures(
            Failure(loop.job.session, f"node-{step}", victim, step, error, "lost")
        )
        log.warning(error)
        for handler in logging.getLogger("trainlab").handlers:
            handler.flush()
        if raylet is not None:
            os.kill(raylet, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def _nodes(loop: Loop) -> list[str | None]:
        """Every rank's node id (a collective: every rank calls it at the same step)."""
        mine = os.environ.get(NODE_ID_ENV)
        if loop.env.world_size == 1:
            return [mine]
        import torch.distributed as dist

        nodes: list[Any] = [None] * loop.env.world_size
        dist.all_gather_object(nodes, mine)
        return nodes
