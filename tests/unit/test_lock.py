"""The locks (requirements/*.txt, devtools/lock.py): current with pyproject.toml,
consistent with its ranges, the CPU lock never asking for CUDA, and the
environment `make setup` built being exactly the lock (CI: a fresh clone)."""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from devtools import lock
from trainlab import envlock as env

REPO = Path(__file__).resolve().parents[2]
# What a venv holds besides the lock: the installer and the project itself.
NOT_LOCKED = {"pip", "setuptools", "wheel", "trainlab"}


def test_every_lock_is_current_with_pyproject():
    assert lock.check() == [], "run `make lock`"


def test_a_changed_requirement_makes_the_lock_stale(tmp_path):
    for rel in ("pyproject.toml", "requirements"):
        src = REPO / rel
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / rel)
    assert lock.check(tmp_path) == []
    text = (tmp_path / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(text.replace('"rich>=13"', '"rich>=14"'))
    assert lock.check(tmp_path) == [
        "requirements/cpu.txt: pyproject.toml or requirements/cpu.in changed since the lock "
        "was made; run `make lock`",
        "requirements/cuda.txt: pyproject.toml or requirements/cuda.in changed since the "
        "lock was made; run `make lock`",
    ]
    # A tool setting is not an input: the lock stays current.
    (tmp_path / "pyproject.toml").write_text(text + "\n[tool.x]\ny = 1\n")
    assert lock.check(tmp_path) == []


@pytest.mark.parametrize("name", sorted(lock.LOCKS))
def test_lock_pins_satisfy_pyproject_and_are_hashed(name):
    pins = env.read_lock(REPO / "requirements" / f"{name}.txt")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"]]
    for extra in lock.LOCKS[name].extras:
        reqs += project["optional-dependencies"][extra]
    for text in reqs:
        req = Requirement(text)
        version = pins[env.canonical(req.name)]
        assert req.specifier.contains(Version(version), prereleases=True), (text, version)
    body = (REPO / "requirements" / f"{name}.txt").read_text()
    assert body.count("==") == len(pins) and body.count("--hash=sha256:") >= len(pins)


def test_cpu_lock_is_torch_cpu_and_cuda_lock_is_torch_cuda():
    cpu = env.read_lock(REPO / "requirements" / "cpu.txt")
    cuda = env.read_lock(REPO / "requirements" / "cuda.txt")
    assert cpu["torch"].endswith("+cpu")
    assert not [n for n in cpu if n.startswith("nvidia-")], "the CPU lock asks for CUDA"
    assert Version(cuda["torch"]).public == Version(cpu["torch"]).public
    assert "nvidia-nccl-cu13" in cuda or any(n.startswith("nvidia-nccl") for n in cuda)
    # The runtime packages both platforms share run the same versions.
    shared = env.runtime_names() - {"torch"}
    differ = {n: (cpu[n], cuda[n]) for n in shared & set(cpu) & set(cuda) if cpu[n] != cuda[n]}
    assert differ == {}


def test_installed_environment_is_the_lock():
    """What `make setup` installed is exactly its lock: every pinned version, and
    nothing else (a venv with `make notebook`'s extra packages only the first)."""
    venv = Path(sys.prefix)
    if not (venv / ".installed").exists():
        pytest.skip(f"{venv} was not built by `make setup`")
    fp = env.fingerprint()
    pins = env.read_lock(REPO / "requirements" / f"{fp['lock']}.txt")
    # What the venv holds (its site-packages), not whatever else the test session's
    # sys.path shows at this moment (a test's temporary folder of wheels).
    import importlib.metadata as md
    import sysconfig

    site = list(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))
    have: dict[str, str] = {}
    for dist in md.distributions(path=site):
        if dist.metadata["Name"]:
            have.setdefault(env.canonical(dist.metadata["Name"]), dist.version)
    wrong = {n: (have.get(n), v) for n, v in pins.items() if have.get(n) != v}
    assert wrong == {}, "installed != lock: `make setup` (the lock changed?)"
    if not (venv / ".notebook-installed").exists():
        assert set(have) - set(pins) - NOT_LOCKED == set()
