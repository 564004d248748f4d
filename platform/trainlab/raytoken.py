"""The auth token of a Ray cluster, found the way Ray 2.60 finds it: `RAY_AUTH_TOKEN`,
else the file at `RAY_AUTH_TOKEN_PATH`, else `~/.ray/auth_token`. Standard library
only: the job client (trainlab.rayjobs.auth) and the training driver
(trainlab.hooksecrets) both read it."""

from __future__ import annotations

import os
from pathlib import Path

from trainlab.errors import UserError


def default_token_path() -> Path:
    return Path.home() / ".ray" / "auth_token"


def auth_token() -> str | None:
    """The token the way Ray finds it; None when there is none."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path_var = os.environ.get("RAY_AUTH_TOKEN_PATH")
    path = Path(path_var).expanduser() if path_var else default_token_path()
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        if path_var:
            raise UserError(f"RAY_AUTH_TOKEN_PATH={path_var}: file not found") from None
        return None
    return token or None
