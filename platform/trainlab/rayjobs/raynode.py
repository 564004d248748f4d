"""`ray start` for the nodes of a loopback-only local cluster.

`python -m trainlab.rayjobs.raynode start [--head | --address=127.0.0.1:PORT] ...`
runs Ray's own `ray start` command with two adjustments, both for a cluster
whose nodes all live on this machine:

- extra nodes are allowed in single-machine mode. That mode
  (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) is what keeps every address on
  127.0.0.1, and plain `ray start --address` refuses to add a node in it.
  Address resolution still sees the mode, so the new node binds to 127.0.0.1.
- a new node gets longer to register with the head. Ray allows 30 s and then
  aborts the node; on a small machine busy with training and tests a healthy
  raylet can take longer. We wait up to TRAINLAB_NODE_REGISTER_TIMEOUT_S
  (default 180 s) before letting Ray's own timeout report the failure.
"""

from __future__ import annotations

import os
import sys
import time
import types

DEFAULT_REGISTER_TIMEOUT_S = 180.0


def allow_extra_nodes() -> None:
    import ray._private.ray_constants as ray_constants
    from ray.scripts import scripts

    # `scripts` reads the flag through its module reference; give it a view where
    # extra nodes are allowed, leaving the real module (address resolution) untouched.
    view = types.ModuleType("ray_constants_multi_node_view")
    view.__dict__.update(ray_constants.__dict__)
    view.ENABLE_RAY_CLUSTER = True
    scripts.ray_constants = view


def patient_registration(timeout_s: float) -> None:
    """Make the node-info lookup Ray polls during startup wait up to `timeout_s`."""
    from ray._private import services

    lookup = services.get_node

    def get_node(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - same as Ray's
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return lookup(*args, **kwargs)
            except RuntimeError:  # not registered yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    services.get_node = get_node


def main() -> int:
    from ray.scripts import scripts

    timeout = os.environ.get("TRAINLAB_NODE_REGISTER_TIMEOUT_S")
    patient_registration(float(timeout) if timeout else DEFAULT_REGISTER_TIMEOUT_S)
    allow_extra_nodes()
    return scripts.main()


if __name__ == "__main__":
    sys.exit(main())
