"""A real tracking server for the tests (issue 40): `trainlab tracking up` in a
throwaway directory on free ports (PostgreSQL from this machine's binaries and
`mlflow server` with sign-in), one per session, shared by the tests that need it
through the `tracking_server` fixture (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NO_POSTGRES = (
    "PostgreSQL's server binaries (initdb, pg_ctl) are not on this machine "
    "(`make test-deps` installs them)"
)


def in_process(*args: str) -> str:
    """`trainlab ARGS` in this process (the real command line, no interpreter
    start-up); returns its stdout, asserting exit 0."""
    import contextlib
    import io

    from trainlab.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(list(args))
    assert exit_.value.code in (0, None), out.getvalue()
    return out.getvalue()


class Server:
    def __init__(self, dir: Path, port: int, env: dict[str, str]):
        self.dir, self.port, self.env = dir, port, env
        self.info: dict = {}

    def up(self) -> dict:
        """`trainlab tracking up --json` (in this process: the servers it starts are
        processes of their own either way)."""
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            args = ("tracking", "up", "--dir", str(self.dir), "--port", str(self.port))
            self.info = json.loads(in_process(*args, "--json"))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return self.info

    def up_again(self) -> dict:
        """`up` again on the same directory and port (in this process: no start-up)."""
        from trainlab.track.server import server_up

        state = server_up(self.dir, port=self.port)
        assert state.info() == self.info
        return self.info

    def down(self) -> dict:
        return json.loads(in_process("tracking", "down", "--dir", str(self.dir), "--json"))

    def status(self) -> dict:
        return json.loads(in_process("tracking", "status", "--dir", str(self.dir), "--json"))

    @property
    def password(self) -> str:
        return Path(self.info["password_file"]).read_text().strip()

    def client_env(self) -> dict[str, str]:
        return {
            "MLFLOW_TRACKING_URI": self.info["uri"],
            "MLFLOW_TRACKING_USERNAME": self.info["username"],
            "MLFLOW_TRACKING_PASSWORD": self.password,
        }

    def sql(self, query: str, *args: object) -> list[tuple]:
        import psycopg2

        db_password = Path(self.info["database_password_file"]).read_text().strip()
        con = psycopg2.connect(self.info["database_uri"], password=db_password)
        try:
            with con.cursor() as cur:
                cur.execute(query, args)
                return cur.fetchall()
        finally:
            con.close()


@pytest.fixture(scope="session")
def tracking_server():
    from trainlab.track.server import free_port, postgres_available

    if not postgres_available():
        pytest.skip(NO_POSTGRES)

    # Under /tmp, not pytest's tmp dir: run as root, the database runs as `postgres`,
    # which must be able to enter the directory (pytest's base is root's alone).
    root = Path(tempfile.mkdtemp(prefix="trainlab-tracking-test-"))
    root.chmod(0o711)  # (mkdtemp's is 0700) entered, not listed
    env = {"TRAINLAB_HOME": str(root / "home"), "MLFLOW_TRACKING_URI": ""}
    srv = Server(root / "server", free_port(), env)
    try:
        srv.up()
        yield srv
    finally:
        from trainlab.track.server import server_down

        server_down(srv.dir)
        shutil.rmtree(root, ignore_errors=True)
