"""The alert hooks' variables travel from `trainlab submit` to the job, as secrets.

The variables `tracking.alerts.hooks` names (webhook URLs, a command's env) are
set on the machine that submits; the alerts are sent by the job's rank-0 worker
on the cluster. They must never appear in the job's runtime env (`ray job list`
and the dashboard show it), the Ray Train loop config, MLflow params or tags,
config files or logs (docs/security.md). The channel:

1. `submit` encrypts `{name: value}` with a key derived from the cluster's auth
   token (every Ray 2.60 cluster has one; submit sends it with each request
   anyway) and writes the ciphertext into the staged working_dir as
   `SECRETS_FILE`. Ray keeps the working_dir package in its object store and
   unpacks it on the job's nodes: what lies on their disks is ciphertext, useless
   without the token, and whoever holds the token can run any code on the cluster.
2. The job's driver (`trainlab train` run by the entry script) decrypts it into
   its own environment (`load_submitted`); a value set on the node already is
   replaced by the submitted one, which the user named explicitly.
3. The driver hands the values to the Ray Train workers in the object store
   (`ray.put`; the train loop config carries only the reference), and rank 0's
   worker puts them into its environment before it builds the alert sinks
   (`for_workers`, `apply_in_worker`).

The same channel carries the MLflow tracking server's credentials
(`TRACKING_CREDENTIALS`: MLflow's own variables, set where the run starts)
to the worker that writes the run's records (rank 0), wherever Ray places it:
`stage_for_job` and `for_workers` always add them to the hooks' names.

Fernet (`cryptography`, AES-128-CBC plus HMAC-SHA256) authenticates the
ciphertext: a file encrypted for another cluster's token is refused, not
misread.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("trainlab.hooksecrets")

# Relative to the job's working_dir (its current directory).
SECRETS_FILE = ".trainlab/hook-secrets.bin"
_KDF_INFO = b"trainlab alert hook secrets v1"
# The tracking server's credentials (MLflow's variables; docs/tracking-teams.md).
TRACKING_CREDENTIALS = (
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)


def _with_tracking(names: Iterable[str]) -> list[str]:
    """`names` and the tracking server's credential variables."""
    names = list(names)
    return names + [n for n in TRACKING_CREDENTIALS if n not in names]


def _fernet(token: str) -> Any:
    from cryptography.fernet import Fernet
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_KDF_INFO).derive(
        token.encode()
    )
    return Fernet(base64.urlsafe_b64encode(key))


def present(names: Iterable[str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of `names` set (non-empty) in `env` (default: this process's)."""
    env = os.environ if env is None else env
    return {n: env[n] for n in names if env.get(n)}


def encrypt(values: Mapping[str, str], token: str) -> bytes:
    return _fernet(token).encrypt(json.dumps(dict(values), sort_keys=True).encode())


def decrypt(blob: bytes, token: str) -> dict[str, str]:
    """The values in `blob`; ValueError when `token` is not the one it was made with."""
    from cryptography.fernet import InvalidToken

    try:
        data = json.loads(_fernet(token).decrypt(blob))
    except InvalidToken:
        raise ValueError("not encrypted with this cluster's auth token") from None
    return {str(k): str(v) for k, v in data.items()}


def stage_for_job(working_dir: Path, names: Iterable[str], token: str | None) -> list[str]:
    """Write the set variables among `names` into the staged `working_dir`, encrypted
    for the cluster whose token is `token`. Returns the names carried (logged by the
    caller; never the values). Without a token nothing is carried: the job's nodes
    then need the variables in their own environment (warned). The tracking
    server's credentials (TRACKING_CREDENTIALS) go with them when set."""
    values = present(_with_tracking(names))
    if not values:
        return []
    if not token:
        log.warning(
            "secret variables %s are not carried to the job: no cluster auth token "
            "to encrypt them with; set them in the environment of the cluster's nodes",
            ", ".join(sorted(values)),
        )
        return []
    path = working_dir / SECRETS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(encrypt(values, token))
    return sorted(values)


def load_submitted(cwd: Path | None = None) -> list[str]:
    """In a submitted job's driver: decrypt the carried variables into this process's
    environment. Returns their names ([] when the job carries none)."""
    path = (cwd or Path.cwd()) / SECRETS_FILE
    if not path.is_file():
        return []
    from trainlab.raytoken import auth_token

    token = auth_token()
    try:
        if not token:
            raise ValueError("this node has no cluster auth token")
        values = decrypt(path.read_bytes(), token)
    except ValueError as e:
        log.warning("the secret variables submitted with this job are not usable: %s", e)
        return []
    os.environ.update(values)
    log.info("secret variables from the submitting machine: %s", ", ".join(sorted(values)))
    return sorted(values)


def for_workers(names: Iterable[str]) -> Any:
    """An object-store reference to the set variables among `names` (None when
    none is set): the train loop config carries the reference, not the values.
    The tracking server's credentials (TRACKING_CREDENTIALS) go with them when set."""
    values = present(_with_tracking(names))
    if not values:
        return None
    import ray

    return ray.put(values)


def apply_in_worker(ref: Any) -> None:
    """In a Ray Train worker: the driver's hook variables into this environment."""
    if ref is None:
        return
    import ray

    os.environ.update(ray.get(ref))
