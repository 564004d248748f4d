"""Connecting to Ray: the cluster at RAY_ADDRESS, or an embedded local one.

The embedded cluster advertises more logical CPUs than the machine has cores
(max(8, 2 x cores)): on a 2-core box a `num_cpus=2` cluster deadlocks as soon
as two 1-CPU training workers and a Ray Data pipeline share it (the data
operators never get a CPU). Work that runs beside training caps its own
resources instead of relying on the count (see trainlab.data and
docs/ray-resources.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

# Ray Train V2's placement-group cleaner asks the state API (served by the
# dashboard) every second whether the controller lives. The embedded cluster has
# no dashboard and dies with its driver, placement groups included, so the
# cleaner has nothing to do there and its "state API unavailable" warning is noise.
_EMBEDDED_NOISE = {
    "ray.train.v2._internal.execution.controller.placement_group_cleaner": "Failed to query Ray Train Controller actor state",
}


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_embedded_worker_logs() -> None:
    """worker_process_setup_hook of the embedded cluster (see _EMBEDDED_NOISE)."""
    for logger_name, prefix in _EMBEDDED_NOISE.items():
        logging.getLogger(logger_name).addFilter(_DropMessages(prefix))


def local_num_cpus(requested: int | None = None) -> int:
    return requested or max(8, 2 * (os.cpu_count() or 1))


def ensure_ray(
    num_cpus: int | None = None,
    address: str | None = None,
    runtime_env: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Connect once per process; return `ray.cluster_resources()`.

    `address` (or RAY_ADDRESS) connects to an existing cluster. Otherwise a new
    local cluster is started with `address="local"`, never silently attaching to
    some other cluster that happens to run on this machine.
    """
    import ray

    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or None
        kwargs: dict[str, Any] = {
            "logging_level": logging.WARNING,
            "log_to_driver": True,
            "configure_logging": True,
        }
        if address:
            if runtime_env:
                kwargs["runtime_env"] = runtime_env
            log.info("connecting to Ray at %s", address)
            ray.init(address=address, **kwargs)
        else:
            kwargs["runtime_env"] = {
                "worker_process_setup_hook": "trainlab.raycluster.quiet_embedded_worker_logs",
                **(runtime_env or {}),
            }
            ray.init(
                address="local",
                num_cpus=local_num_cpus(num_cpus),
                include_dashboard=False,
                **kwargs,
            )
    return ray.cluster_resources()
