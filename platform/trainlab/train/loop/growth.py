"""An elastic run grows at a checkpoint taken for it, not by redoing steps.

Ray Train grows an elastic worker group by restarting it larger from the newest
checkpoint; at an arbitrary moment that throws away the steps since. Instead
(docs/elastic.md), Ray's resize check in the controller
(trainlab.train.driver.elastic.LayoutScalingPolicy) only asks for a checkpoint
(`RunRecords.request_growth`); rank 0 sees the request at a step boundary,
marks it accepted (the controller then waits for the commit, up to an hour: a
large model's checkpoint may take minutes) and asks every rank, with that step's
signals, to HOLD; at the step every rank reads it they take a checkpoint, rank 0 says it is ready (`growth_ready`, once it is
committed), and every rank waits there. The controller then restarts the group
larger from that checkpoint: no step is redone. When the controller cancels (the
capacity went again) or does not act within `HOLD_S` of the commit, the ranks go
on.
"""

from __future__ import annotations

import logging
import time

import torch

from trainlab.run.records import GrowthState
from trainlab.train.loop.protocol import Loop

log = logging.getLogger("trainlab.train")


CHECK_EVERY_S = 1.0  # rank 0 reads the request at most this often (a store read)
POLL_S = 0.5  # while holding
HOLD_S = 120.0  # the longest the ranks wait for the controller's restart


class GrowthHold:
    """Rank 0's side of the growth handshake, and every rank's hold."""

    def __init__(self, elastic: bool):
        self.elastic = elastic
        self.checked_at = float("-inf")
        self.asked_id: str | None = None  # the request rank 0 asked the ranks to hold for

    def ask(self, loop: Loop) -> bool:
        """Rank 0: whether to ask every rank to hold at this step (once per request)."""
        if not (self.elastic and loop.env.is_main):
            return False
        now = time.monotonic()
        if now - self.checked_at < CHECK_EVERY_S:
            return False
        self.checked_at = now
        record = loop.records.growth()
        if record is None or record.state is not GrowthState.REQUESTED:
            return False
        if record.id == self.asked_id:
            return False
        self.asked_id = record.id
        loop.records.growth_accepted(self.asked_id)  # the controller waits for the commit
        return True

    def hold(self, loop: Loop, step: int) -> None:
        """Every rank, after the step's checkpoint was begun: wait for its commit,
        say it is ready (rank 0), then wait together for the restart (the process
        ends) or for the controller to cancel. Rank 0 decides; the other ranks learn
        it by an all-reduce every POLL_S."""
        loop.checkpointer.wait()
        loop.saver.deliver(loop)
        t0 = time.monotonic()  # HOLD_S counts from the commit, however long it took
        main = loop.env.is_main
        if main and self.asked_id is not None:
            loop.records.growth_ready(self.asked_id, step)
            log.info(
                "checkpoint of step %d taken for the elastic run to grow; holding for "
                "the restart at the larger size",
                step,
            )
        while True:
            go_on = 0.0
            if main:
                record = loop.records.growth()
                expired = time.monotonic() - t0 > HOLD_S
                if record is None or record.id != self.asked_id or expired:
                    go_on = 1.0
                    log.info(
                        "the elastic run did not grow (%s); going on from step %d",
                        "no restart came in time" if expired else "cancelled",
                        step,
                    )
                    if expired:
                        loop.records.cancel_growth()
            if loop.env.distributed:
                flag = torch.tensor([go_on], dtype=torch.float64, device=loop.env.device)
                go_on = float(loop.env.all_reduce_sum(flag)[0].item())
            if go_on > 0:
                return
            time.sleep(POLL_S)
