"""The commands docs/models.md and the README's "Bringing a model" give run as
written: every `trainlab validate` and `trainlab plan` line of their bash
blocks (continuation lines joined) exits 0."""

from __future__ import annotations

import re
import shlex

import pytest
from click.testing import CliRunner

from tests.conftest import REPO
from trainlab.cli import cli


def commands(path, section: str | None = None) -> list[list[str]]:
    text = path.read_text()
    if section:
        text = text[text.index(section) :]
        text = text[: text.index("\n## ", 1)]
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()
            if re.match(r"\.venv/bin/trainlab (validate|plan) ", line):
                out.append(shlex.split(line)[1:])
    return out


CASES = commands(REPO / "docs/models.md") + commands(REPO / "README.md", "### Bringing a model")


def test_the_docs_have_commands_to_check():
    assert len(CASES) >= 4


@pytest.mark.parametrize("argv", CASES, ids=lambda a: " ".join(a)[:80])
def test_a_documented_command_runs(argv, monkeypatch):
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(cli, argv, standalone_mode=False)
    assert result.exception is None and result.return_value in (0, None), result.output[-2000:]
