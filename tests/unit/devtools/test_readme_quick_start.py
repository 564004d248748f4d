"""The README's quick start, walked: each of its five commands with the output it
shows. `validate` and `plan` run here and print the lines shown (the plan's rows
that do not depend on this machine's memory); `runs` prints its table's heading
and columns against a real store; `make demo` is a make target whose lines are
devtools/demo.py's; `ui`'s line is trainlab's (the UI test reads it from the real
server, tests/unit/track/test_track_ui.py, which also takes the two screenshots
the quick start shows). The whole demo trains for minutes: tests/e2e covers it."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

import pytest

from tests.conftest import REPO
from tests.unit.track.conftest import _template_db  # noqa: F401 - the session's store
from trainlab.cli import main

README = REPO / "README.md"


def quick_start() -> list[tuple[str, list[str]]]:
    """(command, the lines of the output block after it), in order."""
    text = README.read_text()
    text = text[text.index("## Quick start") :]
    text = text[: text.index("\n## ", 1)]
    pairs = re.findall(r"```bash\n(.*?)\n```\s*\n```text\n(.*?)```", text, re.S)
    return [(cmd.split("  #")[0].strip(), out.strip("\n").splitlines()) for cmd, out in pairs]


def run(capsys, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return e.value.code, out + err


def test_the_quick_start_is_five_commands_with_their_output_and_two_screenshots():
    steps = quick_start()
    assert [c.split()[0:2] for c, _ in steps] == [
        ["make", "demo"],
        [".venv/bin/trainlab", "validate"],
        [".venv/bin/trainlab", "plan"],
        [".venv/bin/trainlab", "runs"],
        [".venv/bin/trainlab", "ui"],
    ]
    text = README.read_text()
    for shot in ("docs/images/mlflow-runs-view.png", "docs/images/mlflow-loss-chart.png"):
        assert f"]({shot})" in text and (REPO / shot).read_bytes()[:4] == b"\x89PNG"
    made = subprocess.run(["make", "-n", "screenshots"], cwd=REPO, capture_output=True, text=True)
    assert made.returncode == 0 and "TRAINLAB_SCREENSHOTS=docs/images" in made.stdout


def test_validate_and_plan_print_what_the_quick_start_shows(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    steps = dict(quick_start())
    for command in (c for c in steps if c.split()[1] in ("validate", "plan")):
        code, out = run(capsys, shlex.split(command)[1:])
        assert code == 0, out
        for line in steps[command]:
            assert line.rstrip() in out, (command, line)


def test_runs_prints_the_heading_and_columns_shown(capsys, monkeypatch, runs_store):
    command, shown = [(c, o) for c, o in quick_start() if c.split()[1] == "runs"][0]
    code, out = run(capsys, [*shlex.split(command)[1:], "--runs-root", str(runs_store)])
    assert code == 0
    assert shown[0].startswith("recent runs in sqlite:///") and "recent runs in sqlite:///" in out
    columns = [c.strip() for c in shown[1].strip("│").split("│")]
    header = next(line for line in out.splitlines() if "run_id" in line)
    assert [c.strip() for c in re.split(r"[┃│]", header) if c.strip()] == columns


def test_make_demo_prints_the_lines_shown():
    command, shown = quick_start()[0]
    made = subprocess.run(["make", "-n", "demo"], cwd=REPO, capture_output=True, text=True)
    assert made.returncode == 0 and "devtools.demo" in made.stdout
    # Each `[demo]` line shown starts as one of the demo's `say(...)` lines does.
    source = (REPO / "devtools" / "demo.py").read_text()
    said = set(re.findall(r'say\(\s*f?"([a-zA-Z]+)', source))
    shown_demo = [ln for ln in shown if ln.startswith("[demo] ")]
    assert len(shown_demo) >= 4
    for line in shown_demo:
        assert line.split()[1] in said, (line, said)


@pytest.fixture
def runs_store(tmp_path, monkeypatch, request):
    """A runs root whose store holds one run recorded by the real callbacks."""
    from tests.unit.track.conftest import FakeRank0, tiny_config

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "runs"
    root.mkdir()
    template = request.getfixturevalue("_template_db")  # the session's initialised store
    shutil.copy(template, root / "mlflow.db")
    FakeRank0(tiny_config(root, "name=tiny"), root).full_run()
    return root
