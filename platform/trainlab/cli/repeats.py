"""`trainlab train CONFIG --repeats K`: K seeds of one experiment trained as a
group (trainlab.repeats: what a group is, its tags, the seeds; docs/noise.md).

The group's MLflow parent run is made here, before its first seed; each seed is
the driver's `run` with TRAINLAB_GROUP_* set, which the driver forwards to the
workers, so the member's records name its group and parent."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from trainlab.errors import UserError
from trainlab.repeats import (
    ENV_GROUP_ID,
    ENV_GROUP_INDEX,
    ENV_GROUP_KEY,
    ENV_GROUP_PARENT,
    ENV_GROUP_SIZE,
    KIND_TAG,
    experiment_key,
    seeded,
)

MAX_REPEATS = 100


def config_key(cfg: Any) -> str:
    from trainlab.config import flatten

    return experiment_key(flatten(cfg.model_dump(mode="json")))


def _parent_run(cfg: Any, group_id: str, key: str, repeats: int) -> tuple[str | None, Any]:
    """The group's MLflow parent run (its id), in the config's experiment."""
    from trainlab.run.location import local_runs_root
    from trainlab.track.backend import artifact_location, client_for, tracking_uri
    from trainlab.track.experiments import get_or_create_experiment
    from trainlab.track.mlflow_cb import experiment_name

    # The embedded store lives in the runs root, or in this machine's working copy
    # of a runs root in object storage.
    root = str(local_runs_root(cfg.train.runs_root, cfg.resource.scratch_dir))
    client = client_for(tracking_uri(root))
    exp_id = get_or_create_experiment(client, experiment_name(cfg), artifact_location(root))
    run = client.create_run(
        exp_id,
        run_name=f"{cfg.name}-x{repeats}-{group_id[:6]}",
        tags={
            KIND_TAG: "group",
            "group_id": group_id,
            "group_size": str(repeats),
            "experiment_key": key,
            "purpose": cfg.purpose,
            "expectation": cfg.expectation,
        },
    )
    return run.info.run_id, client


def run_group(
    cfg: Any,
    repeats: int,
    train_one: Callable[[Any], dict[str, Any]],
    say: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Train `repeats` seeds of `cfg` one after another with `train_one(cfg)` (the
    driver's run); returns {group_id, experiment_key, repeats, status, runs}.
    A member that fails ends the group there (its summary is the last run)."""
    if not 1 <= repeats <= MAX_REPEATS:
        raise UserError(f"--repeats {repeats}: expected 1 to {MAX_REPEATS}")
    group_id = uuid.uuid4().hex[:12]
    key = config_key(cfg)
    parent_id, client = _parent_run(cfg, group_id, key, repeats)
    saved = {
        k: os.environ.get(k)
        for k in (ENV_GROUP_ID, ENV_GROUP_INDEX, ENV_GROUP_SIZE, ENV_GROUP_PARENT, ENV_GROUP_KEY)
    }
    runs: list[dict[str, Any]] = []
    status = "FINISHED"
    try:
        for i in range(repeats):
            member = seeded(cfg, i)
            os.environ.update(
                {
                    ENV_GROUP_ID: group_id,
                    ENV_GROUP_INDEX: str(i),
                    ENV_GROUP_SIZE: str(repeats),
                    ENV_GROUP_PARENT: parent_id or "",
                    ENV_GROUP_KEY: key,
                }
            )
            say(
                f"group {group_id}: seed {i + 1}/{repeats} "
                f"(data.seed={member.data.seed}, train.seed={member.train.seed})"
            )
            summary = train_one(member)
            runs.append(summary)
            if summary.get("status") != "completed":
                status = "FAILED"
                break
    except BaseException:
        status = "FAILED"
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if parent_id:
            client.set_terminated(parent_id, status=status, end_time=int(time.time() * 1000))
    return {
        "group_id": group_id,
        "experiment_key": key,
        "parent_run_id": parent_id,
        "repeats": repeats,
        "status": "completed" if status == "FINISHED" else "failed",
        "runs": runs,
    }


def train_repeats(cfg: Any, repeats: int, as_json: bool, **flags: Any) -> int:
    """`trainlab train CONFIG --repeats K`: the group trained by the driver's `run`;
    the JSON is the group (`group_id`, each run's summary). Exit 0 when every seed
    completed, else 1 (a failed seed ends the group)."""
    import click

    from trainlab.cli.common import echo_json
    from trainlab.train import TrainingFailed, run

    given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v]
    if given:
        raise UserError(
            f"--repeats starts new runs: drop {', '.join(given)} (a group's seeds are "
            "resumed one by one: trainlab train RUN_DIR --resume)"
        )

    def train_one(member: Any) -> dict[str, Any]:
        try:
            return run(member)
        except TrainingFailed as e:
            return e.summary

    group = run_group(cfg, repeats, train_one, say=lambda s: click.echo(s, err=True))
    losses = [r.get("val_loss") for r in group["runs"] if r.get("val_loss") is not None]
    band = ""
    if len(losses) >= 2:
        import statistics

        band = f"; val_loss {statistics.mean(losses):.4f} ± {statistics.stdev(losses):.4f} (sd)"
    click.echo(
        f"group {group['group_id']}: {group['status']}, {len(group['runs'])}/{repeats} "
        f"seed(s){band}; compare with: trainlab compare {group['group_id']}",
        err=True,
    )
    if as_json:
        echo_json(group)
    return 0 if group["status"] == "completed" else 1
