"""A team's tracking server: `mlflow server` on PostgreSQL, sign-in required.

`trainlab tracking up` (trainlab.cli.tracking_cmd) starts, in one directory
(`--dir`, default `{TRAINLAB_HOME or ~/.trainlab}/tracking`; as root
/var/lib/trainlab/tracking):

- a PostgreSQL server from this machine's binaries (initdb, pg_ctl: on PATH or
  under /usr/lib/postgresql/*/bin), its data in `{dir}/postgres`, listening on
  127.0.0.1 only (no unix socket), password authentication (scram-sha-256) for
  its one role `trainlab`; databases `mlflow` (the runs) and `mlflow_auth` (MLflow's
  users and permissions). Or no PostgreSQL at all when the user gives a
  database URI (`--database-uri`, its password from libpq's PGPASSWORD/PGPASSFILE).
- `mlflow server --app-name basic-auth` on 127.0.0.1, every REST request
  signed in (HTTP basic auth), artifacts proxied by the server into
  `{dir}/artifacts` or the `--artifacts` folder or `s3://` URI (the server uses
  this machine's AWS_* settings, as the runs root does), so clients need no
  storage credentials.

Credentials are generated once and kept in owner-only (0600) files of `{dir}`:
`admin-password` (MLflow's admin user `admin`), `database-password` (and the
libpq password file `.pgpass` the server reads), `flask-secret-key`. They reach
the processes through their environment (MLFLOW_AUTH_ADMIN_PASSWORD, PGPASSFILE,
MLFLOW_FLASK_SERVER_SECRET_KEY), never a command line, a URI, the state file or a log.

PostgreSQL refuses to run as root: where trainlab runs as root, the database
server runs as the unprivileged user `postgres` (Debian's postgresql package
makes it; TRAINLAB_POSTGRES_USER names another), owning `{dir}/postgres` only.

`up` again on the same `--dir` (and port) brings the same records back;
`down` stops both servers (the data stays); `status` says what runs.
"""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainlab.errors import UserError
from trainlab.home import home_dir
from trainlab.redact import redact, url_credentials

HOST = "127.0.0.1"
DEFAULT_PORT = 5000
ADMIN_USER = "admin"
DB_ROLE = "trainlab"
DB_NAME = "mlflow"
AUTH_DB_NAME = "mlflow_auth"
STATE_FILE = "server.json"
PASSWORD_FILE = "admin-password"
DB_PASSWORD_FILE = "database-password"
PGPASS_FILE = ".pgpass"
SECRET_KEY_FILE = "flask-secret-key"
AUTH_CONFIG = "basic_auth.ini"
PG_DIR = "postgres"
ARTIFACTS_DIR = "artifacts"
POSTGRES_USER_ENV = "TRAINLAB_POSTGRES_USER"
# Signed-in users may read and write every experiment (a team's shared records);
# docs/tracking-teams.md says how to narrow it with MLflow's permissions API.
DEFAULT_PERMISSION = "EDIT"
PG_BIN_GLOB = "/usr/lib/postgresql/*/bin"
AUTH_CACHE_TTL_S = 60
GRACEFUL_SHUTDOWN_S = 1


ROOT_DEFAULT_DIR = Path("/var/lib/trainlab/tracking")


def default_dir() -> Path:
    """`{TRAINLAB_HOME or ~/.trainlab}/tracking`; run as root without TRAINLAB_HOME,
    ROOT_DEFAULT_DIR (the database's user, `postgres`, cannot enter root's home)."""
    if os.geteuid() == 0 and not os.environ.get("TRAINLAB_HOME"):
        return ROOT_DEFAULT_DIR
    return home_dir() / "tracking"


def _pointer() -> Path:
    """The directory of the latest `tracking up` (what `status`/`down` use by default)."""
    return home_dir() / "tracking-server.json"


@dataclass
class ServerState:
    dir: str
    uri: str
    port: int
    pid: int  # the mlflow server's process group
    artifacts: str
    database_uri: str  # never with a password
    pg_port: int | None = None  # None: a database the user gave
    started_at: float = 0.0

    def info(self) -> dict[str, Any]:
        """What `up --json` prints: where it is and where its credentials are."""
        d = Path(self.dir)
        out: dict[str, Any] = {
            "uri": self.uri,
            "username": ADMIN_USER,
            "password_file": str(d / PASSWORD_FILE),
            "database_uri": self.database_uri,
        }
        if self.pg_port is not None:
            out["database_password_file"] = str(d / DB_PASSWORD_FILE)
        out |= {"artifacts": self.artifacts, "dir": self.dir}
        return out


# --------------------------------------------------------------------------- helpers


def pg_binary(name: str) -> str | None:
    """A PostgreSQL server binary: on PATH, else Debian's /usr/lib/postgresql/N/bin
    (the newest N)."""
    found = shutil.which(name)
    if found:
        return found
    dirs = sorted(
        Path("/").glob(PG_BIN_GLOB.lstrip("/")),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    for d in reversed(dirs):
        if (d / name).is_file():
            return str(d / name)
    return None


def postgres_available() -> bool:
    return pg_binary("initdb") is not None and pg_binary("pg_ctl") is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    """Nothing listens on `port` (connections of a stopped server that linger in
    TIME_WAIT do not count: the servers bind with SO_REUSEADDR too)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _is_mlflow_server(pid: int) -> bool:
    """`pid` is still an `mlflow server` process (a recorded pid may have been reused
    by an unrelated process after the server ended: never signalled then)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"mlflow" in args and b"server" in args


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_group(pgid: int, grace_s: float = 10.0) -> None:
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return
            with contextlib.suppress(ChildProcessError):
                os.waitpid(-pgid, os.WNOHANG)  # our own child: reap it
            time.sleep(0.1)


def _write_private(path: Path, text: str) -> None:
    """`text` into `path`, readable by its owner only (0600 from the start)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _secret(path: Path) -> str:
    """The credential kept in `path`, generated (and kept, 0600) on first use."""
    if path.is_file():
        os.chmod(path, 0o600)
        return path.read_text().strip()
    value = secrets.token_urlsafe(24)
    _write_private(path, value + "\n")
    return value


def read_password(dir: str | os.PathLike[str] | None = None) -> str:
    """The admin password of the server kept in `dir`."""
    return (Path(dir or default_dir()) / PASSWORD_FILE).read_text().strip()


def _tail(path: Path, n: int = 5) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return redact("\n".join(lines[-n:]))


# --------------------------------------------------------------------------- PostgreSQL


class _Postgres:
    """The PostgreSQL server kept in `{dir}/postgres`."""

    def __init__(self, dir: Path):
        self.dir = dir
        self.data = dir / PG_DIR
        self.log = dir / "logs" / "postgres.log"
        self.user = self._server_user()

    @staticmethod
    def _server_user() -> pwd.struct_passwd | None:
        """The unprivileged user the database runs as when we are root, else None."""
        if os.geteuid() != 0:
            return None
        name = os.environ.get(POSTGRES_USER_ENV) or "postgres"
        try:
            user = pwd.getpwnam(name)
        except KeyError:
            raise UserError(
                f"PostgreSQL refuses to run as root and there is no user {name!r} to run it "
                f"as: create one (Debian's postgresql package makes `postgres`), name another "
                f"in {POSTGRES_USER_ENV}, or run trainlab as a regular user"
            ) from None
        if user.pw_uid == 0:
            raise UserError(f"{POSTGRES_USER_ENV}={name}: PostgreSQL cannot run as uid 0")
        return user

    def _run(self, args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        if self.user is not None:
            kw |= {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        return subprocess.run(args, capture_output=True, text=True, env=env, cwd="/", **kw)

    def _own(self, path: Path) -> None:
        if self.user is not None:
            os.chown(path, self.user.pw_uid, self.user.pw_gid)

    def initialized(self) -> bool:
        return (self.data / "PG_VERSION").is_file()

    def init(self, password: str) -> None:
        initdb = pg_binary("initdb")
        if initdb is None:
            raise UserError(
                "PostgreSQL's server binaries (initdb, pg_ctl) are not on this machine "
                f"(looked on PATH and in {PG_BIN_GLOB}): install them (Debian: apt-get "
                "install postgresql) or give a database with --database-uri"
            )
        self.data.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._own(self.data)
        self._check_reachable()
        pwfile = self.data.parent / f".initdb-pw-{os.getpid()}"
        _write_private(pwfile, password + "\n")
        self._own(pwfile)
        try:
            out = self._run(
                [
                    initdb,
                    "-D",
                    str(self.data),
                    "-U",
                    DB_ROLE,
                    "--auth=scram-sha-256",
                    f"--pwfile={pwfile}",
                    "-E",
                    "UTF8",
                    "--no-instructions",
                ]
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if out.returncode != 0:
            raise UserError(f"initdb {self.data} failed: {_last_line(out)}")
        # Loopback TCP only: no unix socket (its path would depend on --dir's length).
        conf = self.data / "postgresql.conf"
        with open(conf, "a") as f:
            f.write(
                "\n# trainlab tracking server (trainlab.track.server)\n"
                f"listen_addresses = '{HOST}'\n"
                "unix_socket_directories = ''\n"
            )

    def _check_reachable(self) -> None:
        """The database user can enter its data directory (every folder above it
        must let it through)."""
        if self.user is None:
            return
        out = self._run(["test", "-w", str(self.data)])
        if out.returncode != 0:
            raise UserError(
                f"--dir {self.dir}: the database server runs as {self.user.pw_name!r} "
                "(PostgreSQL refuses root), which cannot reach it: choose a --dir every folder "
                f"above which {self.user.pw_name!r} may enter (e.g. under /srv or /var/lib), "
                "or run as a regular user"
            )

    def running(self) -> bool:
        pg_ctl = pg_binary("pg_ctl")
        if pg_ctl is None or not self.initialized():
            return False
        return self._run([pg_ctl, "-D", str(self.data), "status"]).returncode == 0

    def start(self, port: int, timeout_s: float = 60.0) -> None:
        pg_ctl = pg_binary("pg_ctl")
        assert pg_ctl is not None
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.touch()
        self._own(self.log)
        out = self._run(
            [
                pg_ctl,
                "-D",
                str(self.data),
                "-l",
                str(self.log),
                "-o",
                f"-p {port}",
                "-w",
                "-t",
                str(int(timeout_s)),
                "start",
            ]
        )
        if out.returncode != 0:
            raise UserError(
                f"PostgreSQL did not start on {HOST}:{port} ({_last_line(out)}); "
                f"last lines of {self.log}:\n{_tail(self.log)}"
            )

    def stop(self) -> None:
        pg_ctl = pg_binary("pg_ctl")
        if pg_ctl is None or not self.running():
            return
        self._run([pg_ctl, "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop"])


def _last_line(out: subprocess.CompletedProcess[str]) -> str:
    lines = (out.stderr or out.stdout or "").strip().splitlines()
    return redact(lines[-1]) if lines else f"exit {out.returncode}"


def _create_databases(port: int, password: str) -> None:
    import psycopg2

    con = psycopg2.connect(
        host=HOST, port=port, user=DB_ROLE, password=password, dbname="postgres", connect_timeout=10
    )
    try:
        con.autocommit = True
        with con.cursor() as cur:
            for name in (DB_NAME, AUTH_DB_NAME):
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cur.fetchone() is None:
                    cur.execute(f'CREATE DATABASE "{name}"')
    finally:
        con.close()


# --------------------------------------------------------------------------- up / down


def read_state(dir: str | os.PathLike[str] | None = None) -> ServerState | None:
    """The recorded server of `dir` (default: the latest `up`'s, else the default
    directory), whether or not it still runs."""
    path = _state_dir(dir) / STATE_FILE
    try:
        return ServerState(**json.loads(path.read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def _state_dir(dir: str | os.PathLike[str] | None) -> Path:
    if dir is not None:
        return Path(dir).expanduser().resolve()
    try:
        return Path(json.loads(_pointer().read_text())["dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return default_dir().resolve()


def server_status(dir: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """`status`: the recorded server with whether each part runs; None if none was started."""
    state = read_state(dir)
    if state is None:
        return None
    pg = _Postgres(Path(state.dir)) if state.pg_port is not None else None
    return {
        **state.info(),
        "mlflow_running": _is_mlflow_server(state.pid),
        "database_running": pg.running() if pg is not None else None,
        "answers": _health(state.uri),
    }


def _health(uri: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def server_up(
    dir: str | os.PathLike[str] | None = None,
    port: int | None = None,
    artifacts: str | None = None,
    database_uri: str | None = None,
    timeout_s: float = 180.0,
) -> ServerState:
    """Start PostgreSQL (unless `database_uri`) and the MLflow server; record and
    return the state. UserError for what the user must change."""
    root = Path(dir).expanduser().resolve() if dir else default_dir().resolve()
    if root.exists() and not root.is_dir():
        raise UserError(f"--dir {root}: not a directory")
    old = read_state(root)
    if old is not None and _is_mlflow_server(old.pid):
        raise UserError(
            f"a tracking server of {root} is already running at {old.uri} "
            f"(`trainlab tracking down --dir {root}` stops it)"
        )
    if database_uri and _has_password(database_uri):
        raise UserError(
            f"--database-uri {redact(database_uri)}: a password never goes in the URI; give it "
            "to the server in PGPASSWORD or a PGPASSFILE (libpq's variables)"
        )
    port = port or (old.port if old else None) or DEFAULT_PORT
    if not port_free(port):
        if old is None and port == DEFAULT_PORT:
            port = free_port()
        else:
            raise UserError(f"--port {port}: already in use on {HOST}; choose another")
    art = _artifact_root(root, artifacts or (old.artifacts if old else None))
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o711 if os.geteuid() == 0 else 0o700)  # root: the database user passes
    (root / "logs").mkdir(exist_ok=True)
    admin_password = _secret(root / PASSWORD_FILE)
    env = {
        **os.environ,
        "MLFLOW_AUTH_CONFIG_PATH": str(root / AUTH_CONFIG),
        "MLFLOW_AUTH_ADMIN_USERNAME": ADMIN_USER,
        "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": _secret(root / SECRET_KEY_FILE),
    }
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        env.pop(k, None)
    pg: _Postgres | None = None
    pg_port: int | None = None
    if database_uri:
        db_uri, auth_uri = database_uri, database_uri
    else:
        pg = _Postgres(root)
        db_password = _secret(root / DB_PASSWORD_FILE)
        _write_private(root / PGPASS_FILE, f"{HOST}:*:*:{DB_ROLE}:{db_password}\n")
        env["PGPASSFILE"] = str(root / PGPASS_FILE)
        env.pop("PGPASSWORD", None)
        if not pg.initialized():
            pg.init(db_password)
        if pg.running():  # left by a server whose MLflow part died: restarted cleanly
            pg.stop()
        pg_port = old.pg_port if old and old.pg_port and port_free(old.pg_port) else free_port()
        pg.start(pg_port)
        try:
            _create_databases(pg_port, db_password)
        except Exception:
            pg.stop()
            raise
        db_uri = f"postgresql://{DB_ROLE}@{HOST}:{pg_port}/{DB_NAME}"
        auth_uri = f"postgresql://{DB_ROLE}@{HOST}:{pg_port}/{AUTH_DB_NAME}"
    _write_auth_config(root / AUTH_CONFIG, _sqlalchemy_uri(auth_uri))
    log = root / "logs" / "mlflow.log"
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        _sqlalchemy_uri(db_uri),
        "--artifacts-destination",
        art,
        "--host",
        HOST,
        "--port",
        str(port),
        "--workers",
        "1",
        "--app-name",
        "basic-auth",
        # `down` does not wait on clients' idle keep-alive connections.
        "--uvicorn-opts",
        f"--timeout-graceful-shutdown {GRACEFUL_SHUTDOWN_S}",
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=root,
            start_new_session=True,
        )
    state = ServerState(
        dir=str(root),
        uri=f"http://{HOST}:{port}",
        port=port,
        pid=proc.pid,
        artifacts=art,
        database_uri=db_uri,
        pg_port=pg_port,
        started_at=time.time(),
    )
    _write_state(root, state)
    try:
        _wait_ready(proc, state.uri, log, timeout_s)
    except BaseException:
        _stop_group(proc.pid)
        if pg is not None:
            pg.stop()
        raise
    return state


def _has_password(uri: str) -> bool:
    """Whether a database URI carries a password (in its user info or libpq's
    `password=` parameter); a user name alone is how the role is named."""
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(uri)
    return parts.password is not None or "password" in parse_qs(parts.query)


def _sqlalchemy_uri(uri: str) -> str:
    """A libpq URI (postgresql://) as SQLAlchemy's psycopg2 URI (the driver in the
    lock; SQLAlchemy's plain `postgresql://` would ask for psycopg 3)."""
    for scheme in ("postgresql://", "postgres://"):
        if uri.startswith(scheme):
            return "postgresql+psycopg2://" + uri.removeprefix(scheme)
    return uri


def _artifact_root(root: Path, artifacts: str | None) -> str:
    """Where the server keeps artifacts: a folder (made here) or an object-store URI."""
    if artifacts and "://" in artifacts:
        if url_credentials(artifacts):
            raise UserError(
                f"--artifacts {redact(artifacts)}: credentials never go in a storage URL; the "
                "server reads them from its environment (AWS_* variables)"
            )
        return artifacts
    path = Path(artifacts).expanduser().resolve() if artifacts else root / ARTIFACTS_DIR
    if path.exists() and not path.is_dir():
        raise UserError(f"--artifacts {path}: not a directory")
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _write_auth_config(path: Path, database_uri: str) -> None:
    """MLflow's basic-auth settings (no credential in it: the admin's password
    comes from MLFLOW_AUTH_ADMIN_PASSWORD, the database's from PGPASSFILE)."""
    config = configparser.ConfigParser()
    config["mlflow"] = {
        "default_permission": DEFAULT_PERMISSION,
        "database_uri": database_uri,
        "admin_username": ADMIN_USER,
        "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth",
        # A checked password is remembered for a minute: without it every request
        # (each batch of a run's metrics) pays a password hash (PBKDF2) on the
        # server. One worker process, so a changed password holds at once.
        "auth_cache_ttl_seconds": str(AUTH_CACHE_TTL_S),
    }
    with open(path, "w") as f:
        config.write(f)


def _wait_ready(proc: subprocess.Popen[bytes], uri: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _health(uri, timeout=2.0):
            return
        if proc.poll() is not None:
            raise UserError(
                f"the MLflow server exited while starting; last lines of {log}:\n{_tail(log)}"
            )
        time.sleep(0.3)
    raise UserError(f"the MLflow server did not answer within {timeout_s:.0f} s; see {log}")


def _write_state(root: Path, state: ServerState) -> None:
    tmp = root / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(asdict(state), indent=2))
    tmp.replace(root / STATE_FILE)
    with contextlib.suppress(OSError):
        home_dir().mkdir(parents=True, exist_ok=True)
        _pointer().write_text(json.dumps({"dir": str(root)}))


def server_down(dir: str | os.PathLike[str] | None = None) -> ServerState | None:
    """Stop the MLflow server and PostgreSQL of `dir` (the data stays); None when
    nothing was recorded there."""
    state = read_state(dir)
    if state is None:
        return None
    if _is_mlflow_server(state.pid):  # our server's process group, not a reused pid
        _stop_group(state.pid)
    if state.pg_port is not None:
        _Postgres(Path(state.dir)).stop()
    return state


# --------------------------------------------------------------------------- clients


class ServerUnavailable(UserError):
    """The tracking server does not answer a command that reads it: one line, exit 1
    (not bad input; a run's records wait in its journal meanwhile)."""

    exit_code = 1


def _ask(uri: str, timeout: float) -> int:
    """The HTTP status of one signed-in request to the server at `uri` (MLflow's
    credential variables; no retries); raises what the request raised."""
    from mlflow.utils.rest_utils import MlflowHostCreds, http_request

    creds = MlflowHostCreds(
        uri,
        username=os.environ.get("MLFLOW_TRACKING_USERNAME") or None,
        password=os.environ.get("MLFLOW_TRACKING_PASSWORD") or None,
        token=os.environ.get("MLFLOW_TRACKING_TOKEN") or None,
    )
    resp = http_request(
        creds,
        "/api/2.0/mlflow/experiments/search",
        "GET",
        params={"max_results": 1},
        max_retries=0,
        timeout=timeout,
    )
    return int(resp.status_code)


def _refused(uri: str, status: int, after: str = "; nothing was started") -> UserError:
    has = any(
        os.environ.get(k)
        for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
    )
    who = (
        "the credentials of MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD"
        + ("/MLFLOW_TRACKING_TOKEN" if os.environ.get("MLFLOW_TRACKING_TOKEN") else "")
        if has
        else "no credentials (set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD)"
    )
    return UserError(
        f"MLFLOW_TRACKING_URI {redact(uri)}: the tracking server refused {who} "
        f"(HTTP {status}){after}"
    )


def check_credentials(uri: str | None = None, timeout: float = 10.0) -> None:
    """Before a run places any worker: a tracking server at `uri` (default
    MLFLOW_TRACKING_URI, when it is http(s)) must accept this environment's
    credentials. Refused (401/403): UserError naming the variables. Unreachable:
    nothing (the run's journal keeps its records until the server answers)."""
    uri = (uri if uri is not None else os.environ.get("MLFLOW_TRACKING_URI", "")).strip()
    if not uri.startswith(("http://", "https://")):
        return
    try:
        status = _ask(uri, timeout)
    except Exception:  # noqa: BLE001 - not reachable now: the journal absorbs an outage
        return
    if status in (401, 403):
        raise _refused(uri, status)


def check_server(uri: str, timeout: float = 10.0) -> None:
    """A command about to read or write the server at `uri`: it answers and accepts
    the credentials, else one line (ServerUnavailable, exit 1; refused, exit 2)
    instead of MLflow's minutes of retries and a traceback."""
    from trainlab.errors import first_line

    try:
        status = _ask(uri, timeout)
    except Exception as e:  # noqa: BLE001 - said in one line
        why = re.search(r"\[Errno -?\d+\] [^\"')]+|timed out|Read timed out", str(e))
        raise ServerUnavailable(
            f"MLFLOW_TRACKING_URI {redact(uri)}: the tracking server does not answer "
            f"({why.group(0) if why else redact(first_line(e))[:120]}); runs' records wait "
            "in their journals until it does (docs/tracking-teams.md)"
        ) from None
    if status in (401, 403):
        raise _refused(uri, status, after="")
