"""The token of a Ray cluster's Jobs API, found the way Ray finds it.

Ray 2.60 clusters require a token: `RAY_AUTH_TOKEN`, else the file at
`RAY_AUTH_TOKEN_PATH`, else `~/.ray/auth_token`. The job client
(`trainlab.rayjobs.client`) sends it as a bearer header; a cluster started here
(`trainlab.rayjobs.localcluster`) makes sure one exists first.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainlab.raytoken import auth_token, default_token_path

__all__ = ["auth_headers", "auth_token", "default_token_path", "ensure_token"]


def ensure_token() -> Path | None:
    """Make sure a token exists for a cluster we start: keep an existing one (other
    clusters on this machine use it), else write a new one readable by us only.
    Returns the file written, or None when a token already existed."""
    if auth_token():
        return None
    import secrets

    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or default_token_path()).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def auth_headers() -> dict[str, str]:
    token = auth_token()
    return {"Authorization": f"Bearer {token}"} if token else {}
