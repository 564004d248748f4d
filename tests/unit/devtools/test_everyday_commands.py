"""Everyday commands print what a user needs: the notebook URL with the token
Jupyter really gets, and the bench's usage without running or overwriting."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO


def test_make_notebook_prints_the_url_with_the_token_jupyter_gets():
    out = subprocess.run(
        ["make", "-n", "notebook"], cwd=REPO, capture_output=True, text=True, timeout=60
    ).stdout
    printed = re.search(r"open http://127\.0\.0\.1:\d+/lab\?token=(\S+)\"", out)
    given = re.search(r"--IdentityProvider\.token=(\S+)", out)
    assert printed and given and printed.group(1) == given.group(1)


def test_bench_help_prints_usage_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from devtools.bench.__main__ import main

    monkeypatch.chdir(tmp_path)
    assert main(["--help"]) == 0
    assert "usage: python -m devtools.bench" in capsys.readouterr().out
    assert main(["no_such_benchmark"]) == 2
    assert not (tmp_path / "bench-results.json").exists()
