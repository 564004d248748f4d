"""The lock files: `make lock` writes them, `make test` checks they are current.

One lock per platform that matters (LOCKS), each a pip requirements file with
every package pinned and hashed, resolved by uv (`uv pip compile`, which can
resolve for another platform than the one it runs on, so both are made here):

- requirements/cpu.txt: the CPU machines (this one, CI): the project, its `dev`
  extra, torch's CPU build. `make setup` installs it.
- requirements/cuda.txt: GPU nodes (cluster/Dockerfile): the project, its `gpu`
  extra, PyPI's torch (CUDA build).

Each lock's first lines record the sha256 of its inputs (pyproject.toml's
requirements and the lock's requirements/NAME.in constraints). `check()` compares
that with the inputs now: a fast check without network, run by
tests/unit/test_lock.py, so CI fails when pyproject.toml changed and the lock
did not. Running `make lock` again keeps every pin the inputs still allow (uv
prefers the versions already in the output file); `python -m devtools.lock
--upgrade` moves everything to the newest versions allowed.

    python -m devtools.lock [--only cpu|cuda] [--upgrade] [--check]

torch's CPU build: uv does not read pip's configuration, so the CPU lock is
resolved with pip's find-links (PIP_FIND_LINKS, else `pip config get
global.find-links`), where this machine keeps the wheel; elsewhere pass
`--find-links DIR` or `--extra-index-url https://download.pytorch.org/whl/cpu`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON_VERSION = "3.11"
PLATFORM = "x86_64-manylinux_2_28"  # Linux x86_64 (glibc >= 2.28), what torch's wheels need
HEADER_KEY = "# inputs-sha256: "
# The cluster specs naming the image (cluster/Dockerfile), whose tag is the CUDA lock's.
SPECS = (
    "cluster/ray-cluster.aws.yaml",
    "cluster/kuberay/raycluster.yaml",
    "cluster/kuberay/rayjob.yaml",
)
IMAGE_RE = re.compile(r"(REGISTRY/trainlab:)[\w.-]+")


@dataclass(frozen=True)
class Lock:
    name: str
    extras: tuple[str, ...]
    about: str
    # The CPU build of torch comes from pip's find-links (a local wheel).
    local_wheels: bool = False

    @property
    def path(self) -> Path:
        return REPO / "requirements" / f"{self.name}.txt"

    @property
    def constraints(self) -> Path:
        return REPO / "requirements" / f"{self.name}.in"


LOCKS = {
    "cpu": Lock("cpu", ("dev",), "Linux x86_64, CPython 3.11, torch CPU: make setup", True),
    "cuda": Lock("cuda", ("gpu",), "Linux x86_64, CPython 3.11, torch CUDA: cluster/Dockerfile"),
}


def inputs_sha256(lock: Lock, repo: Path = REPO) -> str:
    """sha256 of what the lock is resolved from: pyproject.toml's requirements
    (requires-python, dependencies, the lock's extras) and the lock's constraints
    (comments and blank lines left out). Other edits to pyproject.toml (tool
    settings, the version) do not make a lock stale."""
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    constraints = (repo / "requirements" / f"{lock.name}.in").read_text()
    doc = {
        "requires-python": project.get("requires-python"),
        "dependencies": sorted(project.get("dependencies", [])),
        "extras": {e: sorted(extras.get(e, [])) for e in lock.extras},
        "constraints": sorted(
            line.strip()
            for line in constraints.splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def recorded_sha256(path: Path) -> str | None:
    """The inputs hash a lock file records in its header, or None."""
    if not path.is_file():
        return None
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                return None
            if line.startswith(HEADER_KEY):
                return line[len(HEADER_KEY) :].split()[0]
    return None


def check(repo: Path = REPO) -> list[str]:
    """One line per lock that is missing or no longer matches pyproject.toml."""
    problems = []
    for lock in LOCKS.values():
        path = repo / "requirements" / f"{lock.name}.txt"
        recorded = recorded_sha256(path)
        if recorded is None:
            problems.append(f"{path.relative_to(repo)}: missing or without its inputs hash")
        elif recorded != inputs_sha256(lock, repo):
            problems.append(
                f"{path.relative_to(repo)}: pyproject.toml or "
                f"requirements/{lock.name}.in changed since the lock was made; run `make lock`"
            )
    return problems


def _pip_find_links() -> list[str]:
    value = os.environ.get("PIP_FIND_LINKS")
    if not value:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
            capture_output=True,
            text=True,
        )
        value = out.stdout.strip() if out.returncode == 0 else ""
    return value.split()


def _uv() -> str:
    uv = Path(sys.executable).parent / "uv"
    return str(uv) if uv.exists() else "uv"


def write(lock: Lock, extra_args: list[str], upgrade: bool = False) -> None:
    """Resolve `lock` with uv into its file, the inputs hash on top."""
    cmd = [
        _uv(),
        "pip",
        "compile",
        "pyproject.toml",
        *(f"--extra={e}" for e in lock.extras),
        f"--constraint=requirements/{lock.name}.in",
        f"--python-version={PYTHON_VERSION}",
        f"--python-platform={PLATFORM}",
        "--generate-hashes",
        "--no-header",
        "--quiet",
        *(["--upgrade"] if upgrade else []),
    ]
    if lock.local_wheels:
        cmd += [f"--find-links={d}" for d in _pip_find_links()]
    cmd += extra_args
    # uv prefers the pins of the existing output file: resolve into a copy of it.
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / lock.path.name
        if lock.path.is_file():
            out.write_text(lock.path.read_text())
        subprocess.run([*cmd, f"--output-file={out}"], cwd=REPO, check=True)
        body = "\n".join(line for line in out.read_text().splitlines() if not line.startswith("#"))
    body = re.sub(r"^\n+", "", body)
    header = [
        f"# The {lock.name} lock: {lock.about}.",
        "# Made by `make lock` (devtools/lock.py: uv pip compile pyproject.toml "
        f"--extra {' --extra '.join(lock.extras)} -c requirements/{lock.name}.in); do not edit.",
        f"{HEADER_KEY}{inputs_sha256(lock)}",
    ]
    lock.path.write_text("\n".join(header) + "\n" + body.rstrip("\n") + "\n")
    print(f"wrote {lock.path.relative_to(REPO)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.lock", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--only", choices=sorted(LOCKS), action="append")
    parser.add_argument("--upgrade", action="store_true", help="newest versions allowed")
    parser.add_argument("--check", action="store_true", help="only check the locks are current")
    args, extra = parser.parse_known_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    for name in args.only or sorted(LOCKS):
        write(LOCKS[name], extra, args.upgrade)
    retag_specs()
    return 0


def retag_specs(repo: Path = REPO) -> None:
    """Name the image of the current CUDA lock in the cluster specs: a new lock is
    a new image (cluster/README.md says how it is built and pushed)."""
    from trainlab.envlock import file_sha256

    tag = f"cuda-{file_sha256(repo / 'requirements' / 'cuda.txt')[:12]}"
    for rel in SPECS:
        path = repo / rel
        text = path.read_text()
        new = IMAGE_RE.sub(rf"\g<1>{tag}", text)
        if new != text:
            path.write_text(new)
            print(f"{rel}: image REGISTRY/trainlab:{tag}")


if __name__ == "__main__":
    sys.exit(main())
