"""What a submitted job carries to the cluster: the staged working_dir, the
library, the environment, and where its driver runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainlab.errors import UserError
from trainlab.rayjobs import runtime_env as renv
from trainlab.rayjobs.submit import prepare, stage_working_dir, train_entrypoint


def _write(path: Path, size: int = 10) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


@pytest.fixture
def fake_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for rel in [
        "pyproject.toml",
        "trainers/pretrain.py",
        "trainers/recipes/a.yaml",
        "data_prep/sources/x.yaml",
        "notebooks/n.ipynb",
        "cluster/Dockerfile",
        "README.md",
    ]:
        _write(repo / rel)
    for rel in [
        ".git/HEAD",
        ".venv/bin/python",
        "data/demo/prepared/manifest.json",
        "runs/2026-01-01/tiny/checkpoints/step-00000020/model.pt",
        "runs/mlflow.db",
        "mlruns/0/meta.yaml",
        "trainers/__pycache__/x.pyc",
        "platform/trainlab/data/x.py",
        "pkg.egg-info/PKG-INFO",
        "datasets/big/shard.parquet",
    ]:
        _write(repo / rel)
    return repo


def test_collect_keeps_code_and_recipes_and_drops_everything_else(fake_repo: Path):
    pkg = renv.collect(fake_repo, renv.exclude_patterns(fake_repo, ["datasets/big"]))
    shipped = {rel for rel, _ in pkg.files}
    assert shipped == {
        "pyproject.toml",
        "trainers/pretrain.py",
        "trainers/recipes/a.yaml",
        "data_prep/sources/x.yaml",
        "notebooks/n.ipynb",
        "cluster/Dockerfile",
        "README.md",
    }
    assert pkg.total_bytes == 70


def test_configured_paths_outside_the_repo_add_no_pattern(fake_repo: Path, tmp_path: Path):
    base = renv.exclude_patterns(fake_repo)
    assert renv.exclude_patterns(fake_repo, [tmp_path / "elsewhere", "/abs/else", "s3://b/runs", "gs://b/data"]) == base
    assert renv.exclude_patterns(fake_repo, [fake_repo / "datasets"])[-1] == "/datasets/"


def test_excludes_never_touch_the_library_it_ships():
    """Ray applies one excludes list to working_dir and py_modules alike; the
    library has a `data` package that a naive `data` exclude would drop."""
    lib = renv.library_dir()
    pkg = renv.collect(lib, renv.PY_MODULE_EXCLUDES)
    shipped = {rel for rel, _ in pkg.files}
    assert "data/__init__.py" in shipped and "rayjobs/runtime_env.py" in shipped
    assert not any(rel.endswith(".pyc") for rel in shipped)
    env = renv.build_runtime_env("/staged", env_vars={"A": "1"})
    assert env["py_modules"] == [str(lib)]
    assert env["excludes"] == renv.PY_MODULE_EXCLUDES
    assert env["env_vars"] == {"A": "1"}
    assert "py_modules" not in renv.build_runtime_env("/staged", ship_library=False)


def test_a_tree_over_rays_limit_is_refused_naming_its_largest_entries(fake_repo: Path):
    _write(fake_repo / "notebooks/huge.bin", 5000)
    pkg = renv.collect(fake_repo, renv.exclude_patterns(fake_repo, ["datasets"]))
    renv.check_size(pkg, limit=pkg.total_bytes)  # exactly at the limit is fine
    with pytest.raises(UserError) as e:
        renv.check_size(pkg, limit=1000)
    msg = str(e.value)
    assert "over Ray's upload limit" in msg and msg.index("notebooks/") < msg.index("trainers/")


def test_stage_copies_exactly_the_package(fake_repo: Path, tmp_path: Path):
    pkg = renv.collect(fake_repo, renv.exclude_patterns(fake_repo, ["datasets"]))
    dest = renv.stage(pkg, tmp_path / "staged")
    staged = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert staged == sorted(rel for rel, _ in pkg.files)


def test_forwarded_env_has_tracking_and_endpoint_but_no_secrets(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t0ken")
    env = renv.forwarded_env()
    assert env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert "s3cr3t" not in env.values() and "t0ken" not in env.values()


def test_a_submitted_job_carries_the_commit_and_dirty_flag_of_its_repo(tmp_path, monkeypatch):
    """The staged working_dir has no .git: the job learns its code version from the
    runtime env, so its MLflow run records the submitted commit, not "unknown"."""
    import subprocess

    from trainlab.rayjobs.submit import job_runtime_env

    repo = tmp_path / "repo"
    _write(repo / "trainers/pretrain.py")

    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    for var in ("TRAINLAB_GIT_COMMIT", "TRAINLAB_GIT_DIRTY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)  # the repo's version, not that of wherever we run
    wd = tmp_path / "staged"
    env = job_runtime_env(repo, wd)["env_vars"]
    assert env["TRAINLAB_GIT_COMMIT"] == git("rev-parse", "HEAD")
    assert env["TRAINLAB_GIT_DIRTY"] == "false"
    (repo / "trainers/pretrain.py").write_text("changed")
    env = job_runtime_env(repo, wd)["env_vars"]
    assert env["TRAINLAB_GIT_COMMIT"] == git("rev-parse", "HEAD")
    assert env["TRAINLAB_GIT_DIRTY"] == "true"
    from trainlab.track import git_info

    monkeypatch.setenv("TRAINLAB_GIT_COMMIT", env["TRAINLAB_GIT_COMMIT"])
    monkeypatch.setenv("TRAINLAB_GIT_DIRTY", env["TRAINLAB_GIT_DIRTY"])
    assert git_info(wd) == {"commit": git("rev-parse", "HEAD"), "dirty": "true"}  # as the job


def test_driver_reserves_nothing_and_stays_on_the_head():
    opts = renv.entrypoint_options()
    assert opts["entrypoint_num_cpus"] == 0 and opts["entrypoint_num_gpus"] == 0
    assert set(opts["entrypoint_resources"]) == {renv.HEAD_NODE_RESOURCE}


def test_entrypoints():
    assert train_entrypoint("c.yaml") == "python trainers/pretrain.py c.yaml"
    assert train_entrypoint("c.yaml", smoke=True) == "python trainers/pretrain.py c.yaml --smoke"
    assert train_entrypoint("c.yaml", run_dir="/r/a b", retries=2) == (
        "python -m trainlab.rayjobs.retry --retries=2 -- "
        "python trainers/pretrain.py c.yaml --run-dir '/r/a b' --create"
    )


def test_prepare_makes_paths_absolute_and_stages_the_resolved_config(repo, tmp_path):
    recipe = str(repo / "trainers/recipes/tiny.yaml")
    prep = prepare(recipe, ["train.total_steps=30"], repo)
    assert prep.cfg.data.path == str(repo / "data/demo/prepared")
    assert prep.cfg.train.runs_root == str(repo / "runs")
    assert prep.storage_uris == [str(repo / "runs")]
    prep = prepare(recipe, ["train.total_steps=30", f"train.runs_root={tmp_path}/runs"], repo)
    assert prep.run_dir.startswith(f"{tmp_path}/runs/")
    assert prep.run_dir.endswith("/tiny_steps-30")  # named after the change
    rel = stage_working_dir(prep, tmp_path / "wd")
    from trainlab.config import load_config

    shipped = load_config(tmp_path / "wd" / rel)
    assert shipped.train.total_steps == 30 and shipped.name == "tiny_steps-30"
    assert shipped.data.path == str(repo / "data/demo/prepared")
    assert not (tmp_path / "wd" / "platform").exists()
    assert (tmp_path / "wd" / "trainers/recipes/tiny.yaml").is_file()


def test_prepare_refuses_a_plan_that_does_not_fit(repo):
    with pytest.raises(UserError):
        prepare(str(repo / "trainers/recipes/llama_1b.yaml"), ["resource.gpu_memory_gb=4"], repo)


def test_probe_names_what_a_node_cannot_see(tmp_path):
    """The per-node check of the reachability probe (run here without Ray)."""
    from trainlab.rayjobs.probe import check_node

    data, shared, private = tmp_path / "data", tmp_path / "shared", tmp_path / "private"
    for d in (data, shared, private):
        d.mkdir()
    (data / "manifest.json").write_text("{}")
    (shared / ".trainlab-probe-a").write_text(".trainlab-probe-a")
    seen = check_node(str(data), [(str(shared), ".trainlab-probe-a")])
    assert seen["problems"] == []
    seen = check_node(
        str(tmp_path / "nodata"),
        [(str(shared), ".trainlab-probe-a"), (str(private), ".trainlab-probe-b")],
    )
    assert len(seen["problems"]) == 2
    assert "nodata/manifest.json does not exist" in seen["problems"][0]
    assert f"storage {private} is not shared" in seen["problems"][1]


def test_a_submitted_user_architecture_is_imported_from_the_jobs_copy(repo, tmp_path):
    """The staged config names the user architecture's folder relative to itself,
    so the job (which reads it from its uploaded copy) imports the copy's module;
    a folder outside the repository would not travel and is refused."""
    recipe = str(repo / "trainers/recipes/tiny_parallel_alibi.yaml")
    prep = prepare(recipe, [], repo)
    assert prep.cfg.model.code_dir == str(repo / "trainers/models")
    rel = stage_working_dir(prep, tmp_path / "wd")
    from trainlab.config import load_config

    shipped = load_config(tmp_path / "wd" / rel)
    assert shipped.model.code_dir == str(tmp_path / "wd" / "trainers/models")
    assert (tmp_path / "wd" / "trainers/models/parallel_alibi.py").is_file()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "parallel_alibi.py").write_text(
        (repo / "trainers/models/parallel_alibi.py").read_text()
    )
    with pytest.raises(UserError, match="outside the repository"):
        prepare(recipe, [f"model.code_dir={outside}"], repo)
