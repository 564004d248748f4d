"""`trainlab runs` (and compare, ui, gc, mix) without --runs-root read the
project's runs/ wherever in the project they run (from notebooks/ it said "no
runs recorded in .../notebooks/runs/mlflow.db"), and say where they looked and
how to point them at the runs outside any project (issue 41 item 6). Through the
real CLI and a real store holding a run recorded by the real callbacks."""

from __future__ import annotations

import json

import pytest

from tests.unit.track.conftest import FakeRank0, tiny_config
from trainlab.cli import main


def trainlab(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_runs_from_a_sub_folder_reads_the_projects_store(
    runs_root, tmp_path, tmp_path_factory, monkeypatch, capsys
):
    project, runs = tmp_path, runs_root  # the fixture's store: {tmp_path}/runs/mlflow.db
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (project / "notebooks").mkdir()
    FakeRank0(tiny_config(runs, "name=mine"), runs).full_run()
    monkeypatch.chdir(project / "notebooks")
    code, out, _ = trainlab(capsys, "runs", "--json")
    assert code == 0 and [r["name"] for r in json.loads(out)] == ["mine"]
    assert not (project / "notebooks" / "runs").exists()  # nothing created where it stood
    # A path typed on the command line is the shell's: relative to where it runs.
    code, out, _ = trainlab(capsys, "runs", "--runs-root", "../runs", "--json")
    assert code == 0 and len(json.loads(out)) == 1
    # Outside any project: where it looked, and how to point it at the runs.
    outside = tmp_path_factory.mktemp("elsewhere")  # no project at or above it
    monkeypatch.chdir(outside)
    code, out, _ = trainlab(capsys, "runs")
    assert code == 0
    assert f"no runs recorded in sqlite:///{outside}/runs/mlflow.db (no project at or" in out
    assert "give --runs-root DIR" in out
