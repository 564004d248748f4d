"""Run on the cluster before a submission: can every node see the data and storage?

`python -m trainlab.rayjobs.probe --data DIR --storage URI [--storage URI2]` (a
short Ray job submitted by `trainlab submit`). The driver writes a marker file
into each storage location (the runs root); a
zero-CPU task pinned to each alive node checks that the prepared dataset's
manifest is readable there and that every marker is visible there, so a
node-local path that only *looks* shared is caught before training starts.
Prints one `PROBLEM: ...` line per problem and exits 3 if there is any.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import Any

PROBLEM_PREFIX = "PROBLEM: "
RESULT_PREFIX = "PROBE-RESULT: "
EXIT_PROBLEMS = 3


def check_node(data_dir: str, markers: list[tuple[str, str]]) -> dict[str, Any]:
    """What one node sees (runs inside a Ray task on that node, with that node's
    own store settings). `markers`: (storage URI, marker file name) written by
    the head."""
    import socket

    from trainlab.location import locate

    problems = _dataset_seen(data_dir)
    for uri, marker in markers:
        try:
            if locate(uri).read_bytes(marker) != marker.encode():
                problems.append(f"storage {uri}: marker differs on this node")
        except (OSError, ValueError) as e:
            problems.append(
                f"storage {uri} is not shared with this node: the marker written by the "
                f"head is not visible here ({str(e).splitlines()[0]})"
            )
    return {"host": socket.gethostname(), "problems": problems}


def _dataset_seen(data_dir: str) -> list[str]:
    """What is wrong with the prepared dataset at `data_dir` as this node sees it
    (its own disk and mounts, its own store settings: endpoint, credentials)."""
    from trainlab.errors import UserError
    from trainlab.location import Absent, StorageError, locate

    try:
        where = locate(data_dir, what="data.path")
    except UserError as e:
        return [f"prepared data not readable from this node: {e.lines[0]}"]
    manifest = where.uri_of("manifest.json")
    try:
        where.read_bytes("manifest.json")
    except Absent:
        hint = where.backend.settings_hint
        return [
            f"prepared data not found: {manifest} does not exist as seen from this node "
            f"(run `trainlab prep SOURCES --out {where.uri}` where every node sees it: a "
            f"shared filesystem or a store{f'; check this node {hint}' if hint else ''})"
        ]
    except (StorageError, OSError) as e:
        return [f"prepared data not readable from this node: {where.unreachable('', e).lines[0]}"]
    return []


def run(data_dir: str, storage_uris: list[str]) -> list[str]:
    """Probe every alive node; return the problems, each naming its node."""
    from trainlab.errors import UserError
    from trainlab.location import locate

    storages = [locate(uri) for uri in dict.fromkeys(storage_uris)]
    problems = []
    for storage in storages:
        try:
            storage.check_writable()
        except UserError as e:
            problems += [f"head node: {line}" for line in e.lines]
    if problems:
        return problems
    markers = []
    for storage in storages:
        marker = f".trainlab-probe-{uuid.uuid4().hex}"
        storage.write_bytes(marker, marker.encode())
        markers.append((storage, marker))
    try:
        return _probe_nodes(data_dir, [(s.uri, m) for s, m in markers])
    finally:
        for storage, marker in markers:
            storage.delete(marker)


def _probe_nodes(data_dir: str, markers: list[tuple[str, str]]) -> list[str]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(logging_level="WARNING")
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    task = ray.remote(num_cpus=0)(check_node)
    refs = {
        n["NodeID"]: task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(data_dir, markers)
        for n in nodes
    }
    problems = []
    for node_id, ref in refs.items():
        seen = ray.get(ref, timeout=120)
        problems += [f"node {node_id[:8]} ({seen['host']}): {p}" for p in seen["problems"]]
    print(RESULT_PREFIX + json.dumps({"nodes": len(nodes), "problems": len(problems)}))
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainlab.rayjobs.probe")
    ap.add_argument(
        "--data", required=True, help="prepared dataset: an absolute directory or s3:// URI"
    )
    ap.add_argument(
        "--storage",
        required=True,
        action="append",
        help="a storage path or s3:// URI every node must share (repeatable)",
    )
    args = ap.parse_args(argv)
    problems = run(args.data, args.storage)
    for p in problems:
        print(PROBLEM_PREFIX + p, flush=True)
    return EXIT_PROBLEMS if problems else 0


if __name__ == "__main__":
    sys.exit(main())
