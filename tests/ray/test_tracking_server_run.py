"""A real training run on the shared Ray cluster records into the team's tracking
server (issue 40; docs/tracking-teams.md): PostgreSQL + `mlflow server` with
sign-in (the session's `tracking_server`, tests/trackserver.py). The cluster was
started before the credentials were set, so its workers can only have them from
the driver's hand-over (trainlab.hooksecrets); the run's params, every step's
metrics and its artifacts land in the server, no per-machine store is made, and
the password is in none of the run's files or records. Tiny: one worker, 4 steps."""

from __future__ import annotations

import pytest

from tests.train_helpers import dataset_dir, tiny_config

# extended: 25-40 s of Ray training on 2 cores, beyond the tracking tests' share of
# `make test`; the same path without Ray (the real callbacks into the server, the
# credentials' hand-over channel) is in tests/unit/track/test_tracking_server.py and
# tests/unit/security/test_secrets.py.
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.extended]

STEPS = 4


def test_a_ray_run_records_into_the_server_with_credentials_it_never_records(
    ray_cluster, tracking_server, tmp_path_factory, tmp_path, monkeypatch
):
    from mlflow import MlflowClient

    from trainlab.train import run

    for key, value in tracking_server.client_env().items():
        monkeypatch.setenv(key, value)
    password = tracking_server.password
    cfg = tiny_config(
        dataset_dir(tmp_path_factory),
        name="on-the-server",
        train={"total_steps": STEPS, "log_interval": 1, "eval_interval": STEPS,
               "checkpoint": {"every_steps": STEPS}},
        tracking={"experiment": "team-server", "system_metrics": False},
    )
    summary = run(cfg, base_dir=tmp_path)
    assert summary["status"] == "completed" and not summary.get("records_pending")

    client = MlflowClient()
    (mlrun,) = client.search_runs(
        [client.get_experiment_by_name("team-server").experiment_id],
        filter_string="attributes.run_name = 'on-the-server'",
    )
    assert mlrun.info.status == "FINISHED" and mlrun.data.tags["status"] == "completed"
    assert mlrun.data.params["train.total_steps"] == str(STEPS)
    steps = [m.step for m in client.get_metric_history(mlrun.info.run_id, "loss")]
    assert steps == list(range(1, STEPS + 1))
    assert tracking_server.sql(
        "SELECT count(*) FROM metrics WHERE run_uuid = %s AND key = 'loss'", mlrun.info.run_id
    ) == [(STEPS,)]
    artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id)}
    assert {"config.yaml", "plan.json", "run_summary.json", "loss_curve.png"} <= artifacts

    runs_root = tmp_path / "runs"
    assert not (runs_root / "mlflow.db").exists()  # no per-machine store
    values = [*mlrun.data.params.values(), *mlrun.data.tags.values()]
    assert not any(password in v for v in values)
    for path in runs_root.rglob("*"):  # config.yaml, logs (driver, ray, ranks), journal
        if path.is_file():
            assert password.encode() not in path.read_bytes(), path
