"""A loop component for tests/e2e/test_elastic.py, loaded by import path
(`train.components: ["tests.e2e.elastic_components:pace_below_three"]`; the job's
working dir holds tests/).

The test adds a node once the run has shrunk, then expects the run to grow back
before it ends. How long that takes (a raylet start, Ray's resize check, the held
checkpoint) does not scale with the machine's speed, while the steps left do: on
a fast machine the run could end first. Pacing the steps while the run is smaller
than its maximum keeps it training until it has grown, on any machine. A sleep
between steps changes nothing the model computes.
"""

from __future__ import annotations

import time
from typing import Any

from trainlab.train.loop.components import Component

PACE_S = 2.0
FULL_SIZE = 3  # the test's resource.num_workers.max (a worker's config holds its
# actual size, not the range)


class PaceBelowMax(Component):
    def __init__(self, max_workers: int, seconds: float) -> None:
        self.max_workers, self.seconds = max_workers, seconds

    def after_step(self, loop: Any, step: int) -> None:
        if loop.env.world_size < self.max_workers:
            time.sleep(self.seconds)


def pace_below_three(cfg: Any) -> list[Component]:
    return [PaceBelowMax(FULL_SIZE, PACE_S)]
