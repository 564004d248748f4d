"""Secrets stay out of everything the driver records or ships (docs/security.md):
the Ray Train loop config (`TrainJob.env`), the submitted job's runtime env,
configs, MLflow params and tags, and every printed URI."""

from __future__ import annotations

import os
import pickle

import pytest

from trainlab.config import ExperimentConfig
from trainlab.errors import UserError
from trainlab.redact import redact, url_credentials

FAKE = {
    "AWS_ACCESS_KEY_ID": "AKIAFAKEKEYID0001",
    "AWS_SECRET_ACCESS_KEY": "fake-aws-secret-4b1d",
    "AWS_SESSION_TOKEN": "fake-session-token-77c2",
    "MLFLOW_TRACKING_PASSWORD": "fake-mlflow-password-91",
    "MLFLOW_TRACKING_TOKEN": "fake-mlflow-token-5e",
    "TRAINLAB_ALERT_WEBHOOK": "https://hooks.example.com/services/fake-hook-path-33",
    "TRAINLAB_MY_HOOK": "https://chat.example.com/post/fake-named-hook-12",
    "TRAINLAB_CACHE_URL": "https://reader:fake-url-password-08@cache.example.com/x",
}
SETTINGS = {
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
    "AWS_REGION": "eu-west-1",
    "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000",
    "TRAINLAB_GIT_COMMIT": "c0ffee",
}
SECRET_PIECES = ("fake-", "AKIAFAKE")


@pytest.fixture
def fake_env(monkeypatch):
    for k, v in {**FAKE, **SETTINGS}.items():
        monkeypatch.setenv(k, v)


def _no_secret_in(blob: str | bytes) -> None:
    text = blob.decode("latin-1") if isinstance(blob, bytes) else blob
    leaked = [v for v in FAKE.values() if v in text]
    assert not leaked, leaked


def test_the_train_loop_config_carries_settings_but_no_secret(fake_env):
    """`TrainJob.env` travels in Ray Train's loop config (recorded by Ray)."""
    from trainlab.train.driver.launcher import forwarded_env

    cfg = ExperimentConfig.model_validate(
        {"name": "x", "tracking": {"alerts": {"webhook_url_env": "TRAINLAB_MY_HOOK"}}}
    )
    env = forwarded_env(cfg)
    assert {k: env.get(k) for k in SETTINGS} == SETTINGS  # what workers need still goes
    _no_secret_in(pickle.dumps(env))
    _no_secret_in(repr(env))


def test_a_submitted_jobs_runtime_env_has_no_secret(fake_env, tmp_path):
    from trainlab.rayjobs.submit import job_runtime_env

    runtime_env = job_runtime_env(tmp_path, tmp_path / "wd")
    assert runtime_env["env_vars"]["MLFLOW_TRACKING_URI"] == SETTINGS["MLFLOW_TRACKING_URI"]
    _no_secret_in(repr(runtime_env))


def test_a_tracking_uri_with_credentials_is_never_shipped_with_a_job(fake_env, monkeypatch):
    from trainlab.rayjobs import runtime_env as renv

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://bob:fake-uri-password-1@mlflow.example")
    with pytest.raises(UserError) as err:
        renv.forwarded_env()
    assert "MLFLOW_TRACKING_URI" in str(err.value) and "MLFLOW_TRACKING_PASSWORD" in str(err.value)
    assert "fake-uri-password-1" not in str(err.value)


@pytest.mark.parametrize(
    "url",
    ["s3://AKIAFAKE:fake-storage-secret@bucket/runs", "s3://fake-token-only@bucket/runs"],
)
def test_credentials_in_the_storage_url_are_refused_at_validation(tmp_path, url):
    from trainlab.config import load_config
    from trainlab.location import locate

    config = tmp_path / "exp.yaml"
    config.write_text(f"name: exp\ntrain:\n  runs_root: {url}\n")
    with pytest.raises(UserError) as err:
        load_config(config)
    (line,) = err.value.lines
    assert line.startswith(f"{config}: train.runs_root = 's3://***@bucket/runs': ")
    assert "credentials never go in a storage URL" in line and "AWS_ACCESS_KEY_ID" in line
    assert "fake-" not in line and "AKIAFAKE" not in line
    with pytest.raises(UserError) as err:  # the library refuses it too (trainlab.location)
        locate(url)
    assert "fake-" not in str(err.value) and "each node's own environment" in str(err.value)


def test_mlflow_param_and_tag_values_are_redacted():
    """(The real store is checked by tests/ray/test_train.py, the tensor-parallel run.)"""
    from trainlab.track.mlflow_cb import param_value

    assert param_value("https://u:fake-param-pw@h/x?token=fake-q") == "https://***@h/x?token=***"
    assert param_value({"a": "s3://k:fake-s@b"}) == '{"a": "s3://***@b"}'


def test_credentials_in_the_experiments_free_text_are_masked_everywhere_it_is_written(
    tmp_path,
):
    """A URL with credentials pasted into `purpose` was masked in the MLflow params
    but kept verbatim in config.yaml, the config artifact and the journal: masked
    as the config is read, every record holds the same masked text."""
    from trainlab.config import config_hash, load_config, to_yaml
    from trainlab.track.mlflow_cb import run_params

    recipe = "trainers/recipes/tiny.yaml"
    leaked = "compare with https://ana:fake-purpose-pw@dash.example/x?token=fake-tok"
    cfg = load_config(recipe, [f"purpose={leaked}", "owner=https://u:fake-owner-pw@h"])
    assert cfg.purpose == "compare with https://***@dash.example/x?token=***"
    text = to_yaml(cfg) + repr(run_params(cfg, {}))
    assert "fake-purpose-pw" not in text and "fake-tok" not in text
    assert "fake-owner-pw" not in text and "dash.example" in text
    assert config_hash(cfg) == config_hash(load_config(recipe))  # free text: no identity


def test_uris_are_printed_without_their_credentials():
    assert redact("https://u:fake-pw@mlflow.example:5000") == "https://***@mlflow.example:5000"
    assert redact("GET https://h/o?X-Amz-Signature=fake-sig&a=1") == (
        "GET https://h/o?X-Amz-Signature=***&a=1"
    )
    assert url_credentials("s3://k:s@b") and not url_credentials("http://127.0.0.1:5000/x")


def test_hook_variables_travel_to_a_job_encrypted_for_its_cluster(
    fake_env, tmp_path, monkeypatch, caplog
):
    """`submit` stages the hooks' variables encrypted with the cluster's token; the
    job's driver (same token) gets exactly them back; another cluster's cannot."""
    import stat

    from trainlab import hooksecrets

    names = ["TRAINLAB_MY_HOOK", "TRAINLAB_ALERT_WEBHOOK", "TRAINLAB_UNSET_HOOK"]
    carried = hooksecrets.stage_for_job(tmp_path, names, token="cluster-token-1")
    # names only; the tracking server's credentials (MLflow's variables) go the same way
    assert carried == [
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_TOKEN",
        "TRAINLAB_ALERT_WEBHOOK",
        "TRAINLAB_MY_HOOK",
    ]
    staged = tmp_path / hooksecrets.SECRETS_FILE
    assert stat.S_IMODE(staged.stat().st_mode) == 0o600
    for f in tmp_path.rglob("*"):
        if f.is_file():
            _no_secret_in(f.read_bytes())

    wanted = {n: FAKE[n] for n in carried}
    for n in carried:
        monkeypatch.delenv(n)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "cluster-token-1")
    assert hooksecrets.load_submitted(tmp_path) == carried
    assert {n: os.environ[n] for n in carried} == wanted

    for n in carried:
        monkeypatch.delenv(n)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "another-cluster")
    assert hooksecrets.load_submitted(tmp_path) == []
    assert not any(n in os.environ for n in carried)
    assert "not encrypted with this cluster's auth token" in caplog.text
    _no_secret_in(caplog.text)


def test_without_a_cluster_token_hook_variables_are_not_carried(fake_env, tmp_path, caplog):
    from trainlab import hooksecrets

    assert hooksecrets.stage_for_job(tmp_path, ["TRAINLAB_MY_HOOK"], token=None) == []
    assert not (tmp_path / hooksecrets.SECRETS_FILE).exists()
    assert "TRAINLAB_MY_HOOK" in caplog.text and "environment of the cluster's nodes" in caplog.text
