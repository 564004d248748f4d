"""Repeats: K seeds of one experiment run as a group, so the run-to-run noise is
measured, not guessed (`trainlab train CONFIG --repeats K`).

A group is an MLflow parent run (tags `trainlab.kind=group`, `group_id`, the
experiment key) with one child run per seed (`mlflow.parentRunId`, `group_id`,
`group_index`). Seed i of a group trains the config with `data.seed` and
`train.seed` both moved by i (seed 0: the config as written); everything else is
equal, so the members differ only by chance. Their group_id and experiment key
reach the children's records through the environment (TRAINLAB_GROUP_*, which
the driver forwards to the workers): run_summary.json's `group` and the child's
MLflow tags.

Training a group: trainlab.cli.repeats (this module imports no other layer, so
the records and the tracking code can tag a member run). `experiment_key` is
what "the same experiment" means when a single run looks
for a recorded group's noise band (trainlab.track.noise): the config minus
what is not the experiment (seeds, names, the record's prose, tracking).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

ENV_GROUP_ID = "TRAINLAB_GROUP_ID"
ENV_GROUP_INDEX = "TRAINLAB_GROUP_INDEX"
ENV_GROUP_SIZE = "TRAINLAB_GROUP_SIZE"
ENV_GROUP_PARENT = "TRAINLAB_GROUP_PARENT_RUN_ID"
ENV_GROUP_KEY = "TRAINLAB_GROUP_EXPERIMENT_KEY"
KIND_TAG = "trainlab.kind"
# Flattened config keys that do not make another experiment.
NOT_EXPERIMENT = frozenset(
    {"name", "purpose", "expectation", "owner", "data.seed", "train.seed", "train.runs_root"}
)
NOT_EXPERIMENT_PREFIXES = ("tracking.", "plan.")


def experiment_key(params: Mapping[str, Any]) -> str:
    """A short hash of a flattened config (MLflow params or `flatten(cfg)`), values
    as JSON, leaving out seeds, names, the record's prose, tracking and plan."""
    doc = {}
    for key, value in params.items():
        if key in NOT_EXPERIMENT or key.startswith(NOT_EXPERIMENT_PREFIXES):
            continue
        if isinstance(value, str):
            with contextlib.suppress(ValueError):  # MLflow params hold JSON
                value = json.loads(value)
        doc[key] = value
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def seeded(cfg: Any, index: int) -> Any:
    """Member `index` of the group: data.seed and train.seed moved by `index`."""
    d = cfg.model_dump()
    d["data"]["seed"] = (d["data"]["seed"] + index) % 2**31
    d["train"]["seed"] = (d["train"]["seed"] + index) % 2**31
    return type(cfg).model_validate(d)


def group_tags() -> dict[str, str]:
    """A member run's MLflow tags, from the environment its driver set."""
    if not os.environ.get(ENV_GROUP_ID):
        return {}
    tags = {
        "group_id": os.environ[ENV_GROUP_ID],
        "group_index": os.environ.get(ENV_GROUP_INDEX, ""),
        "group_size": os.environ.get(ENV_GROUP_SIZE, ""),
        "experiment_key": os.environ.get(ENV_GROUP_KEY, ""),
    }
    if os.environ.get(ENV_GROUP_PARENT):
        tags["mlflow.parentRunId"] = os.environ[ENV_GROUP_PARENT]
    return {k: v for k, v in tags.items() if v}


def summary_group() -> dict[str, Any] | None:
    """run_summary.json's `group` for a member run, else None."""
    tags = group_tags()
    if not tags:
        return None
    return {
        "group_id": tags["group_id"],
        "index": int(tags.get("group_index", 0)),
        "size": int(tags.get("group_size", 0)),
        "experiment_key": tags.get("experiment_key"),
    }
