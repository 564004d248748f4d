"""The running local cluster of `trainlab cluster up`, for the commands that use Ray.

`cluster up` says "trainlab's commands find this cluster by themselves": `submit`,
`jobs` and `stop` find its Jobs API (trainlab.rayjobs.client.resolve_address), and
the commands that start Ray in their own process (`train`, `tune`, `prep`, `data`,
`mix`) connect to it instead of starting a second, embedded cluster. A driver of
that cluster needs, before Ray is imported (Ray reads them once): RAY_ADDRESS,
token auth (RAY_AUTH_MODE=token) and the loopback-only mode its nodes run in.
RAY_ADDRESS set by the user wins; with no cluster running nothing changes.
Here in the CLI because trainlab.raycluster must not depend on trainlab.rayjobs.
"""

from __future__ import annotations

import os

# Commands that start or connect to Ray in their own process.
RAY_COMMANDS = frozenset({"train", "tune", "prep", "data", "mix"})


def use_local_cluster(args: list[str]) -> str | None:
    """For a Ray command (`args[0]`) with RAY_ADDRESS unset and the local cluster
    running: its address, set in this process's environment (Ray reads it when the
    command connects; trainlab.raycluster.ensure_ray says which cluster). None
    when nothing was set."""
    if not args or args[0] not in RAY_COMMANDS or os.environ.get("RAY_ADDRESS"):
        return None
    if any(a in ("-h", "--help") for a in args):
        return None
    from trainlab.raycluster import LOCAL_CLUSTER_ENV
    from trainlab.rayjobs.localcluster import SINGLE_MACHINE_ENV, read_state

    state = read_state()
    if state is None:
        return None
    os.environ["RAY_ADDRESS"] = state.address
    os.environ[LOCAL_CLUSTER_ENV] = state.address
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    for key, value in SINGLE_MACHINE_ENV.items():
        os.environ.setdefault(key, value)
    return state.address
