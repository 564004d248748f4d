"""Finding the cluster's token the way Ray does, and making one (no cluster needed)."""

from __future__ import annotations

import os
import stat

import pytest

from trainlab.errors import UserError
from trainlab.rayjobs import auth


def test_token_lookup_follows_rays_order(clean_env, monkeypatch):
    assert auth.auth_token() is None and auth.auth_headers() == {}
    default = auth.default_token_path()
    default.parent.mkdir(parents=True)
    default.write_text("from-file\n")
    assert auth.auth_headers() == {"Authorization": "Bearer from-file"}
    other = clean_env / "tok"
    other.write_text("from-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(other))
    assert auth.auth_token() == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert auth.auth_token() == "from-env"
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(clean_env / "missing"))
    with pytest.raises(UserError, match="RAY_AUTH_TOKEN_PATH"):
        auth.auth_token()


def test_ensure_token_creates_a_private_token_and_never_replaces_one(clean_env):
    written = auth.ensure_token()
    assert written == auth.default_token_path()
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600
    token = written.read_text()
    assert len(token) == 64
    assert auth.ensure_token() is None  # other clusters on this machine use it
    assert written.read_text() == token
