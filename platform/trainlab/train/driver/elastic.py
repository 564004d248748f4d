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
"""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy


def whole_groups(count: int, unit: int, lo: int, hi: int) -> int:
    """The largest multiple of `unit` within [0, min(count, hi)]; 0 when that is
    below `lo` (Ray then waits, or gives up: fewer workers than allowed)."""
    n = (min(count, hi) // unit) * unit
    return n if n >= lo else 0


class LayoutScalingPolicy(ElasticScalingPolicy):
    """Ray Train's elastic policy, deciding only sizes that keep tensor and pipeline
    groups whole (multiples of `unit` = tp x pp)."""

    def __init__(self, scaling_config: Any, unit: int):
        super().__init__(scaling_config)
        self.unit = unit

    def _count_possible_workers(self, reserved_resources: Any) -> int:
        count = super()._count_possible_workers(reserved_resources)
        sc = self.scaling_config
        return whole_groups(count, self.unit, sc.min_workers, sc.max_workers)


class ElasticTorchTrainer(TorchTrainer):
    """A TorchTrainer whose controller scales by `LayoutScalingPolicy`. Ray Train's
    own `fit` builds the default policy from the scaling config; this one differs
    only in the policy it hands the controller."""

    def __init__(self, *args: Any, unit: int = 1, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._unit = unit

    def fit(self) -> Any:
        from ray.train.v2._internal.execution.failure_handling import create_failure_policy
        from ray.train.v2._internal.util import ObjectRefWrapper

        result = self._initialize_and_run_controller(
            train_fn_ref=ObjectRefWrapper(self._get_train_func()),
            scaling_policy=LayoutScalingPolicy(self.scaling_config, self._unit),
            failure_policy=create_failure_policy(self.run_config.failure_config),
            train_run_context=self.train_run_context,
            callbacks=self._create_default_callbacks(),
            validation_config=self.validation_config,
        )
        if result.error:
            raise result.error
        return result
