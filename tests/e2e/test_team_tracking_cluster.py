"""A team's tracking server records runs of a cluster whose nodes share no disk,
through an outage (issue 40): the local multi-node cluster (three raylets, each
with its own scratch), the runs root in object storage (moto's S3), the session's
tracking server (PostgreSQL + `mlflow server` with sign-in, tests/trackserver.py)
named by MLFLOW_TRACKING_URI and MLflow's credential variables where the driver
runs, never where the cluster was started. Two runs of one config, 2 workers on
two raylets each: the first with the server up; the second with the server
stopped for 30 s from its first logged step (the run keeps training; what it
could not record waits in its journal, replayed by `track-flush`). Then every
logged step of both is in the server exactly once, no per-machine MLflow store
exists, and `compare` reads both from the server: the same config, the same
losses (deterministic).

extended: a cluster start, two runs and a 30 s outage take about 3 minutes on 2
cores, beyond what `make test` can hold; the same paths without the cluster are
tests/unit/track/test_tracking_server.py (an outage mid-run, exactly once) and
tests/ray/test_tracking_server_run.py (a Ray run into the server, extended too).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.test_store_cluster import (
    BIN,
    REPO,
    TIMEOUT_S,
    _down,
    _sets,
    _trainlab,
    _up,
    make_world,
)

pytestmark = [pytest.mark.slow, pytest.mark.extended]

STEPS = 16
OUTAGE_S = 30


@pytest.fixture(scope="module")
def s3_world(s3_server, tmp_path_factory):
    return make_world("s3", s3_server, tmp_path_factory.mktemp("team-tracking"))


def test_a_team_server_records_two_multi_node_runs_through_an_outage(s3_world, tracking_server):
    import os

    from mlflow import MlflowClient

    world, bucket = s3_world["env"], s3_world["bucket"]
    env = {**world, **tracking_server.client_env()}  # the driver's, not the cluster's
    sets = [*_sets(bucket, "team"), "--set", f"train.total_steps={STEPS}",
            "--set", "train.checkpoint.every_steps=8", "--set", "tracking.experiment=team-e2e"]  # fmt: skip
    _up(world)
    try:
        first = _trainlab("train", "trainers/recipes/tiny.yaml", *sets, "--set", "name=team-a",
                          "--json", env=env)  # fmt: skip
        assert first.returncode == 0, first.stderr[-3000:]
        a = json.loads(first.stdout.strip().splitlines()[-1])
        assert not a.get("records_pending")
        second = subprocess.Popen(
            [str(BIN / "trainlab"), "train", "trainers/recipes/tiny.yaml", *sets,
             "--set", "name=team-b", "--json"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + TIMEOUT_S
        while not any(k.endswith("team-b/logs/progress.json") for k in bucket.keys("team/")):
            assert second.poll() is None, second.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "run b logged no step in time"
            time.sleep(0.5)
        tracking_server.down()
        time.sleep(OUTAGE_S)
        tracking_server.up_again()
        out, err = second.communicate(timeout=TIMEOUT_S)
        assert second.returncode == 0, err[-3000:]
        b = json.loads(out.strip().splitlines()[-1])
        if b.get("records_pending"):  # the run ended while the server was down
            flushed = _trainlab("track-flush", b["run_dir"], env=env)
            assert flushed.returncode == 0, flushed.stderr[-2000:]
    finally:
        _down(world)
    assert a["final_step"] == b["final_step"] == STEPS
    assert a["final_loss"] == b["final_loss"]  # one config, deterministic
    saved = {k: v for k, v in env.items() if k.startswith("MLFLOW_")}
    os.environ.update(saved)
    try:
        client = MlflowClient()
        experiment = client.get_experiment_by_name("team-e2e")
        for name in ("team-a", "team-b"):
            (mlrun,) = client.search_runs(
                [experiment.experiment_id], filter_string=f"attributes.run_name = '{name}'"
            )
            assert mlrun.info.status == "FINISHED", name
            steps = [m.step for m in client.get_metric_history(mlrun.info.run_id, "loss")]
            assert steps == list(range(1, STEPS + 1)), (name, steps)
            assert tracking_server.sql(
                "SELECT count(*) FROM metrics WHERE run_uuid = %s AND key = 'loss'",
                mlrun.info.run_id,
            ) == [(STEPS,)]
    finally:
        for k in saved:
            os.environ.pop(k, None)
    scratch = Path(world["TRAINLAB_SCRATCH_DIR"])
    assert not list(scratch.rglob("mlflow.db"))  # no per-machine store
    compared = _trainlab("compare", "team-a", "team-b", "--json", env=env)
    assert compared.returncode == 0, compared.stderr[-2000:]
    rows = json.loads(compared.stdout.strip().splitlines()[-1])["runs"]
    assert {r["name"] for r in rows} == {"team-a", "team-b"}
    assert {r["status"] for r in rows} == {"completed"}
    assert {r["final_step"] for r in rows} == {STEPS} and {r["records_pending"] for r in rows} == {0}
    assert rows[0]["final_loss"] == rows[1]["final_loss"] == a["final_loss"]
    assert set(rows[0]["differing"]) <= {"name"}, rows[0]["differing"]  # the same config
