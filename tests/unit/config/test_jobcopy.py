"""A config read inside Ray's uploaded copy of a job's working dir (plain `ray job
submit --working-dir .`): a relative data.path or train.runs_root would point into
that copy (no git-ignored data/, deleted with the job) and is refused in one line
naming the key and the fix; absolute paths and s3:// are taken as they are."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trainlab.config import load_config
from trainlab.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def job_copy(tmp_path: Path) -> Path:
    """The recipes as Ray unpacks a `--working-dir .` upload on a node."""
    copy = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0a1b"
    shutil.copytree(REPO / "trainers" / "recipes", copy / "trainers" / "recipes")
    (copy / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    return copy


def test_relative_paths_in_a_job_copy_are_refused_naming_the_fix(job_copy: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(job_copy / "trainers/recipes/tiny.yaml")
    assert [line.split(" = ")[0] for line in e.value.lines] == ["data.path", "train.runs_root"]
    assert all(
        f"Ray's uploaded copy of its working dir ({job_copy})" in line
        and "--set " in line
        and "trainlab submit" in line
        for line in e.value.lines
    )


def test_absolute_paths_and_uris_in_a_job_copy_are_taken(job_copy: Path, tmp_path: Path) -> None:
    cfg = load_config(
        job_copy / "trainers/recipes/tiny.yaml",
        [f"data.path={tmp_path}/prepared", "train.runs_root=/shared/runs"],
    )
    assert (cfg.data.path, cfg.train.runs_root) == (f"{tmp_path}/prepared", "/shared/runs")
    cfg = load_config(
        job_copy / "trainers/recipes/tiny.yaml",
        ["data.path=s3://bucket/prepared", "train.runs_root=/shared/runs"],
    )
    assert cfg.data.path == "s3://bucket/prepared"


def test_outside_a_job_copy_relative_paths_anchor_at_the_repository() -> None:
    cfg = load_config(REPO / "trainers/recipes/tiny.yaml")
    assert cfg.data.path == str(REPO / "data/demo/prepared")
