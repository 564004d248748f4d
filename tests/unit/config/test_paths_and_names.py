"""Paths anchored at the config's repository (never the current directory), run
names that say what `--set` changed, and purpose/expectation for real runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainlab.cli import cli
from trainlab.config import ExperimentConfig
from trainlab.config.loader import config_anchor, load_config, override_name
from trainlab.errors import ConfigError, UserError
from trainlab.run import dir as rundir

CONFIG = """\
name: exp
data: {path: data/prepared}
train: {runs_root: out/runs}
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository (pyproject.toml at its root) with a config two levels down."""
    root = tmp_path / "repo"
    (root / "configs" / "exp").mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (root / "configs" / "exp" / "a.yaml").write_text(CONFIG)
    return root


def test_relative_paths_resolve_against_the_repo_root_not_the_cwd(repo, tmp_path, monkeypatch):
    cfgs = []
    for cwd in (tmp_path, repo / "configs", Path("/")):
        monkeypatch.chdir(cwd)
        cfgs.append(load_config(os.path.relpath(repo / "configs/exp/a.yaml", cwd)))
    assert cfgs[0] == cfgs[1] == cfgs[2]
    cfg = cfgs[0]
    assert cfg.data.path == str(repo / "data/prepared")
    assert cfg.train.runs_root == str(repo / "out/runs")
    # a default is anchored too, an absolute path or a URL is kept, --set anchors alike
    cfg = load_config(repo / "configs/exp/a.yaml", ["train.runs_root=null", "data.path=/abs/d"])
    assert cfg.train.runs_root == str(repo / "runs") and cfg.data.path == "/abs/d"
    s3 = load_config(repo / "configs/exp/a.yaml", ["train.runs_root=s3://b/p"])
    assert s3.train.runs_root == "s3://b/p"


def test_resource_storage_is_read_as_the_runs_root(repo):
    """resource.storage (a checkpoint copy target before runs could live in object
    storage) was folded into train.runs_root: alone it becomes the runs root (with a
    warning); with a different runs_root it is an error saying which to keep."""
    cfg_file = repo / "configs/exp/b.yaml"
    cfg_file.write_text("name: b\nresource: {storage: s3://b/p}\n")
    assert load_config(cfg_file).train.runs_root == "s3://b/p"
    with pytest.raises(ConfigError, match="folded into train.runs_root.*keep only"):
        load_config(repo / "configs/exp/a.yaml", ["resource.storage=s3://b/p"])


def test_anchor_is_the_nearest_git_or_pyproject_else_the_files_directory(tmp_path, repo):
    assert config_anchor(repo / "configs/exp/a.yaml") == repo.resolve()
    (repo / "configs" / ".git").mkdir()  # a nested checkout wins
    assert config_anchor(repo / "configs/exp/a.yaml") == (repo / "configs").resolve()
    loose = tmp_path / "loose" / "b.yaml"  # outside any repository
    loose.parent.mkdir()
    loose.write_text(CONFIG)
    assert config_anchor(loose) == loose.parent.resolve()
    assert load_config(loose).train.runs_root == str(loose.parent.resolve() / "out/runs")


def test_run_directory_records_absolute_paths_from_another_cwd(repo, tmp_path, monkeypatch):
    """The recorded config.yaml of a run holds absolute paths, wherever it started."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(repo / "configs/exp/a.yaml")
    run = rundir.new_run_dir(cfg).local_path()
    assert run.is_relative_to(repo / "out/runs") and not (tmp_path / "out").exists()
    rundir.write_run_files(run, cfg, {})
    recorded = rundir.read_run_config(run)
    assert recorded is not None and recorded.train.runs_root == str(repo / "out/runs")
    assert Path(recorded.data.path).is_absolute()


def test_a_config_built_in_code_is_not_anchored_at_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = ExperimentConfig.model_validate({"name": "n"})  # runs_root: "runs"
    root = rundir.root_location(cfg).local_path()
    assert root != tmp_path / "runs" and (root.parent / "pyproject.toml").is_file()
    assert rundir.root_location(cfg, base_dir=tmp_path).local_path() == tmp_path.resolve() / "runs"
    monkeypatch.setattr(rundir, "_checkout", lambda: None)  # an installed trainlab
    with pytest.raises(UserError, match=r"train.runs_root = 'runs': relative, and the config has no"):
        rundir.root_location(cfg)


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        (["train.lr=1e-3"], "tiny_lr-1e-3"),
        (["train.lr=1e-3", "model.num_layers=4"], "tiny_lr-1e-3_layers-4"),
        # the keys people set most have short labels (loader.LABELS)
        (["train.total_steps=20", "train.eval_interval=10", "train.lr=1e-2"],
         "tiny_steps-20_eval-10_lr-1e-2"),
        (["data.mix={code: 1, docs: 2}"], "tiny_mix-code-1-docs-2"),
        (["train.lr=1e-3", "name=mine"], "tiny"),  # an explicit name wins (set below)
        # not what is trained: layout, resources, paths, record, tracking
        (["parallel.tp=2", "resource.num_workers=4", "train.runs_root=/x/y"], "tiny"),
        (["purpose=why", "tracking.experiment=e", "train.checkpoint.every_steps=5"], "tiny"),
        (["train.seed=../../etc"], "tiny_seed-etc"),  # filesystem-safe
    ],
)
def test_override_name(overrides, name):
    assert override_name("tiny", overrides) == name


def test_override_name_is_short_unique_and_deterministic():
    many = [f"data.mix.source_{i}=0.{i}" for i in range(20)]
    a = override_name("tiny", many)
    b = override_name("tiny", [*many[:-1], "data.mix.source_19=0.5"])  # differs at the end
    assert len(a) == len(b) == 80 and a != b and a[:70] == b[:70]
    assert a == override_name("tiny", [f"data.mix.source_{i}=0.{i}" for i in range(20)])
    ExperimentConfig.model_validate({"name": a})  # a valid name


def test_resume_finds_a_run_named_before_labels_were_short(repo, tmp_path):
    """`--resume` with the same flags finds a run an earlier version named with the
    long labels (`exp_total_steps-200`), and its `-N` sequence."""
    cfg = load_config(repo / "configs/exp/a.yaml", ["train.total_steps=200"], name_from_overrides=True)
    assert cfg.name == "exp_steps-200"
    old = rundir.new_run_dir(cfg).local_path().with_name("exp_total_steps-200-2")
    old.mkdir(parents=True)
    (old / "config.yaml").write_text("name: exp_total_steps-200\n")
    assert rundir.latest_run_dir(cfg).local_path() == old
    assert not rundir._is_run_of("exp_total_steps-2000", "exp_steps-200")


def test_new_runs_are_named_after_their_changes_and_keep_the_sequence(repo, tmp_path):
    cfg = load_config(repo / "configs/exp/a.yaml", ["train.lr=1e-3"], name_from_overrides=True)
    assert cfg.name == "exp_lr-1e-3"
    first = rundir.new_run_dir(cfg).local_path()
    first.mkdir(parents=True)
    second = rundir.new_run_dir(cfg).local_path()
    assert (first.name, second.name) == ("exp_lr-1e-3", "exp_lr-1e-3-2")
    assert first.parent.parent == repo / "out/runs"
    # a resume keeps the run's name: --set does not rename it
    assert load_config(repo / "configs/exp/a.yaml", ["train.lr=1e-3"]).name == "exp"
    explicit = ["train.lr=1e-3", "name=lr_sweep"]
    assert load_config(repo / "configs/exp/a.yaml", explicit, True).name == "lr_sweep"


def test_train_without_purpose_or_expectation_exits_2_unless_smoke(repo):
    config = str(repo / "configs/exp/a.yaml")
    res = CliRunner().invoke(cli, ["train", config], standalone_mode=False)
    assert isinstance(res.exception, ConfigError)
    assert "purpose and expectation: required for trainlab train" in str(res.exception)
    res = CliRunner().invoke(cli, ["train", config, "--set", "purpose=p"], standalone_mode=False)
    assert "expectation: required" in str(res.exception)
    # with both given, the next problem is a real one (the dataset does not exist)
    res = CliRunner().invoke(
        cli,
        ["train", config, "--set", "purpose=p", "--set", "expectation=e"],
        standalone_mode=False,
    )
    assert isinstance(res.exception, UserError) and "required" not in str(res.exception)
    # --smoke, validate and plan do not ask for them
    res = CliRunner().invoke(cli, ["train", config, "--smoke"], standalone_mode=False)
    assert "required" not in str(res.exception)
    for cmd in ("validate", "plan"):
        assert CliRunner().invoke(cli, [cmd, config], standalone_mode=False).exception is None


def test_submit_requires_purpose_and_expectation(repo):
    from trainlab.rayjobs.submit import prepare

    with pytest.raises(ConfigError, match="required for trainlab submit"):
        prepare(str(repo / "configs/exp/a.yaml"), (), repo)


def test_cli_exit_code_for_missing_purpose_is_2(repo):
    out = subprocess.run(
        [sys.executable, "-m", "trainlab", "train", str(repo / "configs/exp/a.yaml")],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "purpose and expectation: required" in lines[0]
