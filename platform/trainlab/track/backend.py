"""Where experiment records live: the MLflow tracking store.

Embedded default (no server to run): a SQLite store in the runs root,
`sqlite:///{abs runs_root}/mlflow.db`, with artifacts under
`{abs runs_root}/mlartifacts` (for a runs root in object storage: in its
working copy on this machine's scratch, trainlab.run.location.local_runs_root). When `MLFLOW_TRACKING_URI` is set, that store
(usually a tracking server) is used instead and decides where artifacts go.
Everything here imports mlflow lazily: config commands never pay for it.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

from trainlab.track.experiments import (  # noqa: F401 - re-exported
    EXPERIMENT_KIND_TAG,
    MODEL_TRAINING_KIND,
    get_or_create_experiment,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient

ENV_TRACKING_URI = "MLFLOW_TRACKING_URI"
DB_FILE = "mlflow.db"
ARTIFACTS_DIR = "mlartifacts"


def tracking_uri(runs_root: str | os.PathLike[str]) -> str:
    """The tracking URI for runs under `runs_root`: `MLFLOW_TRACKING_URI` when
    set, else the embedded SQLite store in the runs root."""
    env = os.environ.get(ENV_TRACKING_URI, "").strip()
    if env:
        return env
    return f"sqlite:///{_local_root(runs_root) / DB_FILE}"


def _local_root(runs_root: str | os.PathLike[str]) -> Path:
    """The directory of the embedded store: the runs root, or for a runs root in
    object storage its working copy on this machine (SQLite cannot live in a
    store; docs/storage.md)."""
    from trainlab.run.location import local_runs_root

    return local_runs_root(os.fspath(runs_root)).resolve()


def artifact_location(runs_root: str | os.PathLike[str]) -> str | None:
    """Artifact root for new experiments: `{abs runs_root}/mlartifacts` for the
    embedded store; None (the server decides) when `MLFLOW_TRACKING_URI` is set."""
    if os.environ.get(ENV_TRACKING_URI, "").strip():
        return None
    return (_local_root(runs_root) / ARTIFACTS_DIR).as_uri()


def is_server(uri: str) -> bool:
    """A tracking server (MLFLOW_TRACKING_URI=http(s)://...), not a store on disk."""
    return uri.startswith(("http://", "https://"))


# A run's records reach a server through its journal, which retries by itself
# (trainlab.track.journal.retry_s): MLflow's own retries of a request (7, with
# back-off: about 4 minutes) would hold a run's flusher, heartbeat and end that
# long on an outage. The user's own settings of these variables are kept.
# MLflow's client also prints each ended run's server link on stdout: not in a
# run's output.
FAIL_FAST_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


def fail_fast_on_outage(uri: str) -> None:
    """In a process that records a run into the server `uri`: a request that finds
    the server down fails at once (the journal keeps the record, FAIL_FAST_HTTP)."""
    if is_server(uri):
        for key, value in FAIL_FAST_HTTP.items():
            os.environ.setdefault(key, value)


def is_embedded(uri: str) -> bool:
    return uri.startswith("sqlite:///")


def embedded_db_path(uri: str) -> Path | None:
    """The database file of an embedded store URI, else None."""
    return Path(uri.removeprefix("sqlite:///")) if is_embedded(uri) else None


def client_for(uri: str, flush_records: bool = True) -> MlflowClient:
    """An MLflow client on `uri`; creates the embedded store's folder if needed.

    Every trainlab command that touches the store opens it here, so this is where
    runs whose processes vanished are ended as `lost` (trainlab.track.heartbeat
    .correct_lost: one query of the RUNNING runs), and where the records that
    waited for a busy store are written: with `flush_records`, the pending
    journals of the run directories under the embedded store's runs root
    (trainlab.track.journal.flush_pending; a stat per run directory when none wait).

    A new embedded store is created under an exclusive file lock (`mlflow.db.lock`,
    `filelock.FileLock`): runs starting at once on a fresh runs root (Tune trials,
    two `trainlab train`) would otherwise race MLflow's table creation ("table ...
    already exists"). It is built in a side file and renamed into place
    (`_create_embedded`), so a process killed during the creation leaves no
    half-made database behind."""
    from filelock import FileLock
    from mlflow import MlflowClient

    from trainlab.track.heartbeat import correct_lost

    db = embedded_db_path(uri)
    if is_server(uri):  # down or refusing: one line, not minutes of retries
        from trainlab.track.server import check_server

        check_server(uri)
    if db is None:
        client = MlflowClient(tracking_uri=uri)
    else:
        db.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(db.with_name(db.name + ".lock")):
            if not db.exists():
                _create_embedded(db)
            client = MlflowClient(tracking_uri=uri)
            client.search_experiments(max_results=1)  # creates or migrates the tables
    correct_lost(client)
    if flush_records and db is not None:
        from trainlab.track.journal import flush_pending

        flush_pending(client, db.parent)
    return client


def _create_embedded(db: Path) -> None:
    """Create the embedded store in `.mlflow.db.new-{pid}` and rename it to `db`.
    MLflow creates its tables one statement at a time: a process killed in the
    middle (a worker group torn down by Ray, a Ctrl-C) would leave a database on
    which every later open fails ("table ... already exists"), and every record
    of the runs root would wait in journals. The caller holds the store's lock, so
    side files found here are leftovers of killed creators.

    MLflow gives a new store a "Default" experiment (id 0) whose artifacts go to
    `./mlruns` of whichever process opened it first (a Ray worker: Ray's session
    folder). trainlab records every run in a named experiment, so the store is
    made with its own artifact root (`{runs root}/mlartifacts`) and Default is
    deleted (kept as MLflow needs it, out of the UI and of `search_experiments`).

    Creating MLflow's tables runs its ~50 migrations (3.8 s on our machines, paid by
    every new runs root: a Tune sweep's, each test's). They run once per MLflow
    version into a template in trainlab's cache (`_template`); a new store is a
    copy of it with Default's artifact root set, the migrations run again only
    where the cache cannot be written or read."""
    for stale in db.parent.glob(f".{db.name}.new-*"):
        stale.unlink(missing_ok=True)
    side = db.with_name(f".{db.name}.new-{os.getpid()}")
    artifacts = (db.parent / ARTIFACTS_DIR).as_uri()
    template = _template()
    if template is not None:
        try:
            shutil.copyfile(template, side)
            _point_default_at(side, artifacts)
            os.replace(side, db)
            return
        except (OSError, sqlite3.Error):
            side.unlink(missing_ok=True)
    _build_store(side, artifacts)
    os.replace(side, db)


def _build_store(path: Path, artifacts: str) -> None:
    """MLflow's tables (every migration) in a new database at `path`, Default deleted."""
    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    try:
        _initialize_tables(engine)
    finally:
        engine.dispose()
    store = SqlAlchemyStore(f"sqlite:///{path}", artifacts)
    try:
        store.delete_experiment(store.DEFAULT_EXPERIMENT_ID)
    finally:
        store.engine.dispose()


def _point_default_at(path: Path, artifacts: str) -> None:
    """Default's artifact location in the store copied to `path`, as MLflow would
    have made it with `artifacts` as the artifact root."""
    con = sqlite3.connect(path)
    try:
        with con:
            changed = con.execute(
                "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                (f"{artifacts}/0",),
            ).rowcount
        if changed != 1:
            raise sqlite3.DatabaseError("the template has no Default experiment")
    finally:
        con.close()


def _template() -> Path | None:
    """`{trainlab home}/cache/mlflow-store-{mlflow version}.db`: an embedded store
    with every migration run and Default deleted, built on first use (under a
    file lock, in a side file renamed into place). None where it cannot be made."""
    import mlflow
    from filelock import FileLock

    from trainlab.home import cache_dir

    path = cache_dir() / f"mlflow-store-{mlflow.__version__}.db"
    if _usable(path):
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(path.with_name(path.name + ".lock")):
            if not _usable(path):
                for stale in path.parent.glob(f".{path.name}.new-*"):  # killed builders'
                    stale.unlink(missing_ok=True)
                side = path.with_name(f".{path.name}.new-{os.getpid()}")
                try:
                    _build_store(side, (path.parent / ARTIFACTS_DIR).as_uri())
                    os.replace(side, path)
                finally:
                    side.unlink(missing_ok=True)
    except OSError:
        return None
    return path if _usable(path) else None


def _usable(template: Path) -> bool:
    """A complete template: MLflow's migration table names a revision."""
    if not template.is_file():
        return False
    try:
        con = sqlite3.connect(f"{template.as_uri()}?mode=ro", uri=True)
        try:
            row = con.execute("SELECT version_num FROM alembic_version").fetchone()
        finally:
            con.close()
    except sqlite3.Error:
        return False
    return bool(row and row[0])
