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
import os
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

    problems = []
    manifest = os.path.join(data_dir, "manifest.json")
    if not locate(data_dir).is_local:  # a store: this node's endpoint and credentials reach it?
        problems += _dataset_in_store(data_dir)
    elif not os.path.isfile(manifest):
        problems.append(
            f"prepared data not found: {manifest} does not exist on this node "
            "(run `trainlab prep` there, or put data.path on a shared filesystem)"
        )
    elif not os.access(manifest, os.R_OK):
        problems.append(f"prepared data not readable: {manifest}")
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


def _dataset_in_store(uri: str) -> list[str]:
    """A dataset in object storage as this node sees it (its own settings: endpoint,
    credentials)."""
    from trainlab.errors import UserError
    from trainlab.location import StorageError, locate

    try:
        where = locate(uri, what="data.path")
        if not where.is_file("manifest.json"):
            return [
                f"prepared data not found: {where.uri_of('manifest.json')} does not exist "
                "as seen from this node (run `trainlab prep SOURCES --out "
                f"{where.uri}`, or check this node's store settings, e.g. AWS_ENDPOINT_URL)"
            ]
    except StorageError as e:
        return [f"prepared data not readable from this node: {where.unreachable('', e).lines[0]}"]
    except UserError as e:
        return [f"prepared data not readable from this node: {e.lines[0]}"]
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
