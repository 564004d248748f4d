"""A team's tracking server (issue 40): `trainlab tracking up` starts a real
PostgreSQL (this machine's initdb/pg_ctl, a throwaway directory, free ports)
and a real `mlflow server` with MLflow's basic auth; nothing is mocked. One
server per session (tests/trackserver.py): every test here shares it (its start
costs ~10 s).

Checked: what `up --json` says and the owner-only credential files; an
unauthenticated REST request is refused; a signed-in client's run lands in
PostgreSQL's runs/metrics tables; a training run's records (params, metrics,
artifacts) reach the server through the real callbacks with no credential in
any record; an outage (server down mid-run, the run ending while it is down,
then `up` again on the same directory and port) loses and doubles nothing;
a server refusing the credentials stops `trainlab train` before it starts;
`tracking import` copies an embedded store, idempotently, metrics identical."""

from __future__ import annotations

import json
import shutil
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.trackserver import NO_POSTGRES, Server
from tests.unit.track.conftest import FakeRank0, tiny_config
from trainlab.track.server import postgres_available

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(not postgres_available(), reason=NO_POSTGRES)


@pytest.fixture
def server(tracking_server):
    return tracking_server


@pytest.fixture
def signed_in(server, monkeypatch):
    for k, v in server.client_env().items():
        monkeypatch.setenv(k, v)
    return server


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """`trainlab ARGS` in this process (the real command line; no interpreter start-up)."""
    from trainlab.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(Path(path).stat().st_mode)


def test_up_says_where_it_is_and_keeps_its_credentials_owner_only(server, capsys):
    info = server.info
    assert info["uri"] == f"http://127.0.0.1:{server.port}"
    assert info["username"] == "admin"
    assert info["database_uri"].startswith("postgresql://trainlab@127.0.0.1:")
    for key in ("password_file", "database_password_file"):
        assert _mode(info[key]) == 0o600 and Path(info[key]).read_text().strip()
    secrets = [server.password, Path(info["database_password_file"]).read_text().strip()]
    # Never in what it prints, its state, its settings, its logs or its command lines.
    texts = [json.dumps(info)]
    texts += [p.read_text(errors="replace") for p in server.dir.glob("*.json")]
    texts += [p.read_text(errors="replace") for p in server.dir.glob("*.ini")]
    texts += [p.read_text(errors="replace") for p in (server.dir / "logs").iterdir()]
    pid = json.loads((server.dir / "server.json").read_text())["pid"]
    texts.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"))
    for text in texts:
        assert not any(s in text for s in secrets)
    status = server.status()
    code, _, err = cli(capsys, "tracking", "up", "--dir", str(server.dir))  # up twice
    assert code == 2 and "already running at " + info["uri"] in err.strip().splitlines()[-1]
    assert status["answers"] and status["mlflow_running"] and status["database_running"]
    # Loopback only: both servers listen on 127.0.0.1.
    pg_port = int(info["database_uri"].rsplit(":", 1)[1].split("/")[0])
    listening = Path("/proc/net/tcp").read_text().splitlines()[1:]
    local = {line.split()[1] for line in listening if line.split()[3] == "0A"}
    for port in (server.port, pg_port):
        assert f"0100007F:{port:04X}" in local and f"00000000:{port:04X}" not in local


def test_unauthenticated_requests_are_refused_and_a_signed_in_run_lands_in_postgres(
    signed_in,
):
    from mlflow import MlflowClient

    server = signed_in
    url = f"{server.info['uri']}/api/2.0/mlflow/experiments/search?max_results=1"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=10)
    assert err.value.code == 401
    wrong = urllib.request.Request(url, headers={"Authorization": "Basic YWRtaW46bm9wZQ=="})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(wrong, timeout=10)
    assert err.value.code == 401

    client = MlflowClient()  # MLflow's own variables: URI, user, password
    run_id = client.create_run(client.create_experiment("signed-in")).info.run_id
    for step in (1, 2, 3):
        client.log_metric(run_id, "loss", 1.0 / step, step=step)
    assert server.sql("SELECT count(*) FROM runs WHERE run_uuid = %s", run_id) == [(1,)]
    assert server.sql(
        "SELECT step, value FROM metrics WHERE run_uuid = %s AND key = 'loss' ORDER BY step",
        run_id,
    ) == [(1, 1.0), (2, 0.5), (3, 1 / 3)]


def _loss_steps(server: Server, run_id: str) -> list[int]:
    rows = server.sql(
        "SELECT step FROM metrics WHERE run_uuid = %s AND key = 'loss' ORDER BY step", run_id
    )
    return [r[0] for r in rows]


def test_a_runs_records_reach_the_server_and_survive_its_outage(
    signed_in, tmp_path, monkeypatch, capsys
):
    """The real callbacks of a run's rank 0 write into the server; it goes down
    mid-run (training never waits on it), the run ends while it is down (its
    records wait in the journal), `up` again on the same directory and port
    brings the same records back, and `track-flush` writes what waited: every
    step once, the params, the artifacts, and no credential anywhere."""
    from mlflow import MlflowClient

    from trainlab.track.journal import Journal

    server = signed_in
    monkeypatch.setenv("TRAINLAB_STORE_RETRY_S", "0.2")
    monkeypatch.setenv("TRAINLAB_STORE_END_WAIT_S", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    runs_root = tmp_path / "runs"
    r0 = FakeRank0(tiny_config(runs_root), runs_root)
    r0.start()
    sent = r0.steps(1, 30)
    assert r0.callbacks.callbacks[0].flush(60) == 0
    run_id = r0.callbacks.callbacks[0].run_id
    assert _loss_steps(server, run_id) == sorted(sent)
    assert not (runs_root / "mlflow.db").exists()  # no per-machine store

    server.down()
    t0 = time.monotonic()
    sent |= r0.steps(31, 60)
    assert time.monotonic() - t0 < 10  # logging never waits on the server
    summary = {"name": r0.cfg.name, "status": "completed", "final_step": 60}
    r0.callbacks.on_run_end(summary)
    assert time.monotonic() - t0 < 30  # nor does the run's end (bounded wait)
    assert summary["records_pending"] > 0
    assert Journal(r0.run_dir).pending_count() == summary["records_pending"]

    assert server.up_again()["uri"] == f"http://127.0.0.1:{server.port}"  # same records
    assert _loss_steps(server, run_id) == sorted(s for s in sent if s <= 30)
    code, out, err = cli(capsys, "track-flush", str(r0.run_dir), "--runs-root", str(runs_root))
    assert code == 0 and "the store has them all" in out, err[-2000:]
    assert Journal(r0.run_dir).pending_count() == 0
    assert _loss_steps(server, run_id) == sorted(sent)  # every step, once

    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["status"] == "completed"
    code, out, err = cli(capsys, "compare", "--json", "--runs-root", str(runs_root))
    assert code == 0, err[-2000:]
    assert run_id in [r["run_id"] for r in json.loads(out)["runs"]]  # read from the server
    assert run.data.params["train.total_steps"] == "60"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "plan.json", "run_summary.json", "loss_curve.png"} <= artifacts
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/")
    stored = list(Path(server.info["artifacts"]).rglob(f"{run_id}/artifacts/config.yaml"))
    assert len(stored) == 1  # the server wrote it into its artifact root

    # No credential in any record: params, tags, artifacts, the journal.
    password = server.password
    assert not any(password in v for v in [*run.data.params.values(), *run.data.tags.values()])
    assert password not in Path(client.download_artifacts(run_id, "config.yaml")).read_text()
    for path in r0.run_dir.rglob("*"):
        if path.is_file():
            assert password.encode() not in path.read_bytes(), path


def test_a_server_refusing_the_credentials_stops_train_before_anything_starts(
    signed_in, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
    config = str(REPO / "trainers/recipes/tiny.yaml")
    code, _, err = cli(capsys, "train", config, "--set", f"train.runs_root={tmp_path}")
    assert code == 2, err[-2000:]
    (line,) = err.strip().splitlines()
    assert line.startswith("error: MLFLOW_TRACKING_URI http://127.0.0.1:")
    assert "refused the credentials" in line and "MLFLOW_TRACKING_PASSWORD" in line
    assert "not-the-password" not in err
    assert list(tmp_path.iterdir()) == []  # no run directory, no store, no worker


def test_import_copies_an_embedded_history_once_with_identical_metrics(
    signed_in, tmp_path, capsys, _template_db
):
    from mlflow import MlflowClient

    db = tmp_path / "old" / "mlflow.db"
    db.parent.mkdir()
    shutil.copy(_template_db, db)  # an initialised embedded store (tests/unit/track/conftest.py)
    old = MlflowClient(f"sqlite:///{db}")
    exp = old.create_experiment("past", artifact_location=(tmp_path / "art").as_uri())
    ids = []
    for i in range(2):
        run = old.create_run(exp, run_name=f"past-{i}", tags={"purpose": "history"})
        rid = run.info.run_id
        old.log_param(rid, "train.lr", str(0.001 * (i + 1)))
        for step in range(1, 21):
            old.log_metric(
                rid, "loss", 5.0 / step + i, step=step, timestamp=1_700_000_000_000 + step
            )
        (tmp_path / "notes.txt").write_text(f"run {i}")
        old.log_artifact(rid, str(tmp_path / "notes.txt"))
        old.set_terminated(rid, "FINISHED", end_time=1_700_000_100_000)
        ids.append(rid)

    code, out, err = cli(capsys, "tracking", "import", "--from", f"sqlite:///{db}", "--json")
    assert code == 0, err[-2000:]
    first = json.loads(out)
    assert (first["copied"], first["skipped"]) == (2, 0)
    code, out, err = cli(capsys, "tracking", "import", "--from", str(db.parent), "--json")
    second = json.loads(out)
    assert (second["copied"], second["skipped"]) == (0, 2)
    assert second["runs"] == first["runs"]

    new = MlflowClient()
    for rid in ids:
        copy = new.get_run(first["runs"][rid])
        assert copy.info.run_name == old.get_run(rid).info.run_name
        assert copy.info.status == "FINISHED" and copy.info.end_time == 1_700_000_100_000
        assert copy.data.params == old.get_run(rid).data.params
        assert copy.data.tags["purpose"] == "history"

        def history(client, run_id):
            return [
                (m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, "loss")
            ]

        assert history(new, copy.info.run_id) == history(old, rid)
        notes = Path(new.download_artifacts(copy.info.run_id, "notes.txt")).read_text()
        assert notes.startswith("run ")
    code, _, err = cli(capsys, "tracking", "import", "--from", str(tmp_path / "nowhere"))
    assert code == 2 and err.startswith("error: --from ") and len(err.splitlines()) == 1


def test_the_database_binaries_are_found_on_path_or_under_debians_folder(monkeypatch):
    from trainlab.track.server import PG_BIN_GLOB, pg_binary

    debian = sorted(Path("/").glob(PG_BIN_GLOB.lstrip("/") + "/initdb"))
    if not debian:
        pytest.skip(f"no initdb under {PG_BIN_GLOB} here")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert pg_binary("initdb") == str(debian[-1])


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--database-uri", "postgresql://bob:fake-db-pw@db.example/mlflow", "PGPASSWORD"),
        ("--database-uri", "postgresql://bob@db.example/mlflow?password=fake-db-pw", "PGPASSWORD"),
        ("--artifacts", "s3://AKIAFAKE:fake-s3-secret@bucket/art", "AWS_*"),
    ],
)
def test_credentials_in_a_uri_are_refused_in_one_line_before_anything_starts(
    tmp_path, capsys, flag, value, says
):
    code, _, err = cli(capsys, "tracking", "up", "--dir", str(tmp_path / "srv"), flag, value)
    assert code == 2
    (line,) = [ln for ln in err.strip().splitlines() if not ln.startswith("starting")]
    assert line.startswith(f"error: {flag} ") and says in line and "fake-" not in line
    assert not (tmp_path / "srv").exists()


def test_commands_that_read_the_server_say_it_is_down_or_refusing_in_one_line(
    server, monkeypatch, capsys, tmp_path
):
    from trainlab.track.server import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing there
    code, _, err = cli(capsys, "runs", "--runs-root", str(tmp_path))
    (line,) = err.strip().splitlines()
    assert code == 1 and "the tracking server does not answer" in line, err
    for key, value in server.client_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
    code, _, err = cli(capsys, "compare", "--runs-root", str(tmp_path))
    (line,) = err.strip().splitlines()
    assert code == 2 and "refused the credentials" in line and "not-the-password" not in err


def test_a_server_on_a_given_database_keeps_artifacts_in_object_storage(
    server, s3_env, tmp_path, monkeypatch
):
    """`tracking up --database-uri URI --artifacts s3://...`: a team's server on a
    database it did not create (here the session server's, as a second server of a
    team would share it; its password from libpq's PGPASSWORD, never in the URI)
    with the artifacts in
    object storage through the runs root's settings (AWS_* variables, moto's S3):
    a signed-in client's artifact is stored as an object in the bucket, proxied by
    the server (the client holds no storage credential), and read back."""
    from mlflow import MlflowClient

    from trainlab.track.server import free_port, server_down, server_up

    s3, bucket = s3_env
    monkeypatch.setenv(
        "PGPASSWORD", Path(server.info["database_password_file"]).read_text().strip()
    )
    monkeypatch.setenv("TRAINLAB_HOME", str(tmp_path / "home"))
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(key, raising=False)
    srv = tmp_path / "srv"
    state = server_up(
        srv,
        port=free_port(),
        artifacts=f"s3://{bucket}/mlflow-artifacts",
        database_uri=server.info["database_uri"],
    )
    try:
        info = state.info()
        assert info["artifacts"] == f"s3://{bucket}/mlflow-artifacts"
        assert "database_password_file" not in info  # the database is not ours
        # The client knows the server and its sign-in only: no storage credential.
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", info["uri"])
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", info["username"])
        monkeypatch.setenv(
            "MLFLOW_TRACKING_PASSWORD", Path(info["password_file"]).read_text().strip()
        )
        client = MlflowClient()
        run_id = client.create_run(client.create_experiment("art-s3")).info.run_id
        note = tmp_path / "notes.txt"
        note.write_text("kept in the bucket\n")
        client.log_artifact(run_id, str(note))
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
        assert [k for k in keys if k.endswith(f"{run_id}/artifacts/notes.txt")], keys
        back = client.download_artifacts(run_id, "notes.txt", str(tmp_path / "back"))
        assert Path(back).read_text() == "kept in the bucket\n"
        assert not list(srv.glob("artifacts/**/notes.txt"))  # nothing beside the server
    finally:
        server_down(srv)
