"""Fixtures of the jobs tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRAINLAB_HOME", str(tmp_path / "trainlab"))
    return tmp_path
