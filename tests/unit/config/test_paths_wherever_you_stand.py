"""Relative paths mean the same wherever a command runs (issue 41 item 6): a
personal config outside the repository that extends a recipe takes the recipe's
paths as the recipe wrote them; validate says when a local dataset or a runs
root's parent does not exist. (`trainlab runs` from a project's sub-folder:
tests/unit/track/test_runs_root_default.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainlab.cli import main
from trainlab.config.loader import load_config

RECIPE = """\
name: recipe
purpose: p
expectation: e
data: {path: data/prepared}
train: {runs_root: runs}
"""


def trainlab(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out, err = capsys.readouterr()
    return e.value.code, out, err


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "recipes").mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (root / "recipes" / "recipe.yaml").write_text(RECIPE)
    return root


def test_a_personal_config_outside_the_repo_inherits_the_recipes_paths(project, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    mine = home / "mine.yaml"
    mine.write_text(f"extends: {project / 'recipes' / 'recipe.yaml'}\nname: mine\n")
    cfg = load_config(mine)
    assert cfg.data.path == str(project / "data" / "prepared")  # was {home}/data/prepared
    assert cfg.train.runs_root == str(project / "runs")
    # Its own relative paths are its own folder's (no repository above it).
    mine.write_text(mine.read_text() + "train: {runs_root: myruns}\n")
    assert load_config(mine).train.runs_root == str(home / "myruns")
    # Within one repository nothing changes: the repository root anchors every file.
    inside = project / "recipes" / "sub" / "v.yaml"
    inside.parent.mkdir()
    inside.write_text("extends: ../recipe.yaml\n")
    assert load_config(inside).data.path == str(project / "data" / "prepared")


def test_validate_says_a_missing_dataset_and_runs_root_parent(project, tmp_path, capsys):
    recipe = str(project / "recipes" / "recipe.yaml")
    code, out, err = trainlab(capsys, "validate", recipe, "--set", "train.runs_root=/nope/x/runs")
    assert code == 0 and out == "ok recipe\n"
    assert f"note: data.path = {project}/data/prepared: no such directory" in err
    assert "note: train.runs_root = /nope/x/runs: its parent /nope/x does not exist" in err
    (project / "data" / "prepared").mkdir(parents=True)  # there now (its manifest: train's)
    code, out, err = trainlab(capsys, "validate", recipe)
    assert code == 0 and out == "ok recipe\n" and err == ""
