"""The cluster's auth token never travels in clear to another machine: a plain
http:// address that is not loopback is refused before any connection, unless
--allow-plain-http says so (docs/security.md)."""

from __future__ import annotations

import pytest

from trainlab.cli import main
from trainlab.errors import UserError
from trainlab.rayjobs import client


@pytest.mark.parametrize(
    ("url", "exposed"),
    [
        ("http://10.1.2.3:8265", True),
        ("http://head.cluster.example:8265", True),
        ("http://127.0.0.1:8265", False),
        ("http://127.8.9.1:8265", False),
        ("http://localhost:8265", False),
        ("http://[::1]:8265", False),
        ("https://10.1.2.3:8265", False),
    ],
)
def test_which_addresses_would_expose_the_token(url, exposed):
    assert (client.plain_http_problem(url, has_token=True) is not None) is exposed
    assert client.plain_http_problem(url, has_token=False) is None  # nothing to expose


def test_connect_refuses_before_sending_anything(clean_env, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "fake-cluster-token")
    with pytest.raises(UserError) as err:
        client.connect("http://10.1.2.3:8265")  # refused before any network traffic
    message = str(err.value)
    assert "travel in clear text" in message and "--allow-plain-http" in message
    assert "https://" in message and "fake-cluster-token" not in message


@pytest.mark.parametrize("command", [["jobs"], ["stop", "some-job"]])
def test_the_cli_exits_2_with_one_line(clean_env, monkeypatch, capsys, command):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "fake-cluster-token")
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--address", "http://10.1.2.3:8265"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert err[0].startswith("error: --address http://10.1.2.3:8265: the cluster's auth token")
