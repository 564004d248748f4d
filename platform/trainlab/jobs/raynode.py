"""`ray start` for an extra raylet of a loopback-only local cluster.

`python -m trainlab.jobs.raynode start --address=127.0.0.1:PORT ...` runs Ray's
own `ray start` with one check lifted: in single-machine mode
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which keeps every address on 127.0.0.1)
`ray start` refuses to add a node. Nothing else changes; the node's address
resolution still sees the single-machine setting, so it binds to 127.0.0.1 too.
"""

from __future__ import annotations

import sys
import types


def main() -> int:
    import ray._private.ray_constants as ray_constants
    from ray.scripts import scripts

    # `scripts` reads the flag through its module reference; give it a view where
    # extra nodes are allowed, leaving the real module (address resolution) untouched.
    view = types.ModuleType("ray_constants_multi_node_view")
    view.__dict__.update(ray_constants.__dict__)
    view.ENABLE_RAY_CLUSTER = True
    scripts.ray_constants = view
    return scripts.main()


if __name__ == "__main__":
    sys.exit(main())
