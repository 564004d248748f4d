"""Where records go: the embedded store in the runs root unless MLFLOW_TRACKING_URI
is set; how config values become MLflow params and come back."""

from __future__ import annotations

from tests.unit.track.conftest import RECIPES
from trainlab.config import load_config
from trainlab.track import artifact_location, tracking_uri
from trainlab.track.mlflow_cb import metric_name, param_value, run_key, run_params
from trainlab.track.query import parse_param


def test_embedded_store_lives_in_the_absolute_runs_root(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert tracking_uri("runs") == f"sqlite:///{tmp_path}/runs/mlflow.db"
    assert artifact_location("runs") == (tmp_path / "runs" / "mlartifacts").as_uri()


def test_tracking_server_from_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking_uri("runs") == "http://127.0.0.1:5000"
    assert artifact_location("runs") is None  # the server decides


def test_params_are_the_flattened_config_and_read_back_typed(tmp_path):
    cfg = load_config(RECIPES / "tiny.yaml", ["train.chaos.kill_at_steps=[5, 9]"])
    params = run_params(
        cfg,
        {
            "num_params": 123,
            "strategy": "ddp",
            "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 0},
            "memory_per_device_bytes": {"total": 3 * 2**30},
        },
    )
    assert params["data.mix.code"] == "0.5"
    assert params["plan.num_params"] == "123" and params["plan.dp"] == "2"
    assert params["plan.memory_per_device_gb"] == "3.000"
    assert parse_param(params["train.lr"]) == cfg.train.lr
    assert parse_param(params["train.chaos.kill_at_steps"]) == [5, 9]
    assert parse_param(params["model.tie_embeddings"]) is True
    assert parse_param(params["model.arch"]) == "llama"
    assert parse_param(params["model.num_kv_heads"]) == 2
    assert len(param_value("x" * 10_000)) == 6000  # MLflow's limit, not an error


def test_run_key_and_metric_names():
    assert run_key("/a/b/../b/run") == run_key("/a/b/run")
    assert run_key("/a/b/run") != run_key("/a/b/run2")
    assert metric_name("share/code-v2.x") == "share/code-v2.x"
    assert metric_name("share/c++") == "share/c__"


def _open_store_at_once(uri: str, barrier, results) -> None:
    from trainlab.track.backend import client_for, get_or_create_experiment

    barrier.wait()
    try:
        client = client_for(uri)
        get_or_create_experiment(client, "tiny", None)
        results.put("ok")
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put(f"{type(e).__name__}: {e}"[:300])


def test_runs_starting_at_once_on_a_fresh_runs_root_share_one_store(tmp_path):
    """Tune trials (or two `trainlab train`) opening a new embedded store together."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    uri = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [
        ctx.Process(target=_open_store_at_once, args=(uri, barrier, results)) for _ in range(3)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert outcomes == ["ok"] * 3, outcomes


_KILLED_CREATOR = """
import os, sys
import mlflow.store.db.utils as db_utils
from trainlab.track.backend import client_for

def killed(engine):  # the first tables exist, the migrations never run
    os._exit(9)

db_utils._upgrade_db = killed
client_for(sys.argv[1])
"""


def test_a_process_killed_while_creating_the_store_leaves_it_usable(tmp_path, monkeypatch):
    """A worker group torn down while its rank 0 creates a fresh embedded store
    (seen in CI; here: while it runs MLflow's migrations into the template): the
    next process opens the store and records in it, nothing half-made left."""
    import os
    import subprocess
    import sys

    from trainlab.track.backend import client_for, get_or_create_experiment

    db = tmp_path / "runs" / "mlflow.db"
    uri = f"sqlite:///{db}"
    monkeypatch.setenv("TRAINLAB_HOME", str(tmp_path / "home"))
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_CREATOR, uri], timeout=120, env=dict(os.environ)
    )
    assert killed.returncode == 9
    assert not db.exists()  # nothing half-made under the store's name
    client = client_for(uri)
    experiment = get_or_create_experiment(client, "tiny", None)
    run = client.create_run(experiment)
    client.log_metric(run.info.run_id, "loss", 1.5, step=1)
    assert client.get_metric_history(run.info.run_id, "loss")[0].value == 1.5
    assert [p.name for p in db.parent.iterdir() if p.name.startswith(".")] == []
    cache = tmp_path / "home" / "cache"
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []


def test_a_new_store_has_no_default_experiment_in_the_processs_folder(tmp_path, monkeypatch):
    """MLflow gives a new store a "Default" experiment whose artifacts go to ./mlruns
    of the process that opened it first (a Ray worker: Ray's session folder); the
    UI listed it beside the real ones. Made here, it is deleted, its artifacts root
    the runs root's."""
    from mlflow.entities import ViewType

    from trainlab.track.backend import client_for

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    elsewhere = tmp_path / "ray-session"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    client = client_for(tracking_uri(tmp_path / "runs"))
    assert client.search_experiments() == []
    (default,) = client.search_experiments(view_type=ViewType.ALL)
    assert default.name == "Default" and default.lifecycle_stage == "deleted"
    assert default.artifact_location.startswith((tmp_path / "runs" / "mlartifacts").as_uri())
    assert list(elsewhere.iterdir()) == []


def test_new_stores_are_copies_of_one_migrated_template(tmp_path, monkeypatch):
    """MLflow's migrations run once per MLflow version (3.8 s each new runs root
    paid before); a new store is the cached template with Default's artifact root
    its own, and a damaged template is rebuilt rather than copied."""
    import sqlite3

    from mlflow.entities import ViewType

    from trainlab.track.backend import client_for, get_or_create_experiment

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("TRAINLAB_HOME", str(tmp_path / "home"))
    stores = []
    for name in ("a", "b"):
        client = client_for(tracking_uri(tmp_path / name))
        (default,) = client.search_experiments(view_type=ViewType.ALL)
        assert default.lifecycle_stage == "deleted"
        assert default.artifact_location == f"{(tmp_path / name / 'mlartifacts').as_uri()}/0"
        stores.append(client)
    (template,) = (tmp_path / "home" / "cache").glob("mlflow-store-*.db")
    experiment = get_or_create_experiment(stores[0], "tiny", artifact_location(tmp_path / "a"))
    run = stores[0].create_run(experiment)
    assert stores[1].search_experiments() == []
    assert sqlite3.connect(template).execute("SELECT count(*) FROM runs").fetchone() == (0,)
    assert run.info.artifact_uri.startswith((tmp_path / "a" / "mlartifacts").as_uri())

    template.write_bytes(b"not a database")  # damaged: rebuilt, the store made anyway
    client = client_for(tracking_uri(tmp_path / "c"))
    assert client.search_experiments() == []
    assert sqlite3.connect(template).execute("SELECT count(*) FROM runs").fetchone() == (0,)
    # A home where no cache can be made (a file): the migrations run in place.
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("TRAINLAB_HOME", str(tmp_path / "not-a-folder"))
    client = client_for(tracking_uri(tmp_path / "d"))
    (default,) = client.search_experiments(view_type=ViewType.ALL)
    assert default.artifact_location.startswith((tmp_path / "d" / "mlartifacts").as_uri())
