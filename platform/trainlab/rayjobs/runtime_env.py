"""The runtime environment of a submitted job: what the cluster gets from us.

- `working_dir`: the repository minus what must not travel (`.git`, `.venv`,
  prepared data, run outputs, MLflow stores, caches, the library itself). It is
  staged into a temporary directory first, so the size check sees exactly what
  will be uploaded and the excludes never touch the library (Ray applies one
  `excludes` list to `working_dir` *and* `py_modules`, and the library has a
  `data` package of its own).
- `py_modules`: the library (`platform/trainlab`), so the cluster runs the
  code being submitted, unless the cluster image has trainlab installed.
- `env_vars`: tracking and S3 endpoint settings. Never secrets: credentials
  come from the cluster's own environment (instance role, pod secret); a
  setting with credentials in its URL is refused (`forwarded_env`).

Ray refuses a package over its gRPC message limit (512 MiB); we check the
staged size first and name the largest entries when a tree is too large.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainlab.errors import UserError
from trainlab.location import SETTINGS_ENV_VARS, locate

# Excluded wherever they appear (gitignore syntax).
EXCLUDE_ANYWHERE = (
    ".git/",
    ".venv/",
    "venv/",
    "__pycache__/",
    "*.pyc",
    ".pytest_cache/",
    ".ruff_cache/",
    ".mypy_cache/",
    ".ipynb_checkpoints/",
    "*.egg-info/",
    "mlruns/",
    "mlartifacts/",
    "mlflow.db",
    "*.sqlite",
)
# Excluded at the repository root only: prepared data, run outputs, and the
# library, which travels as a py_module instead.
EXCLUDE_AT_ROOT = ("/data/", "/runs/", "/platform/", "/bench-results.json")
# Applied by Ray to py_modules (and to the already clean staged working_dir).
PY_MODULE_EXCLUDES = ["__pycache__/", "*.pyc"]

# Ray's upload limit: the gRPC message size (ray_constants.GRPC_CPP_MAX_MESSAGE_SIZE).
DEFAULT_MAX_PACKAGE_BYTES = 512 * 1024 * 1024
# Environment variables forwarded to the job when set here (none of them secret).
FORWARDED_ENV_VARS = (
    "MLFLOW_TRACKING_URI",
    *SETTINGS_ENV_VARS,  # the stores' endpoints, regions, projects (trainlab.location)
    # --allow-env-drift (trainlab.envlock: the job's node check records, not stops)
    "TRAINLAB_ALLOW_ENV_DRIFT",
)
# The image the job expects its nodes to run: the CUDA lock's (cluster/Dockerfile).
IMAGE_ENV = "TRAINLAB_IMAGE"
# The driver runs on the head node and reserves no CPU or GPU: every CPU/GPU of
# the cluster stays available to training workers (a 2-worker run on a 2-CPU
# cluster must still fit) and the driver never lands on, or holds, a GPU node.
HEAD_NODE_RESOURCE = "node:__internal_head__"


def max_package_bytes() -> int:
    """Ray's limit for one uploaded package (overridable like Ray's own setting)."""
    return int(os.environ.get("RAY_max_grpc_message_size", DEFAULT_MAX_PACKAGE_BYTES))  # noqa: SIM112


def entrypoint_options() -> dict[str, Any]:
    """Keyword arguments for `JobSubmissionClient.submit_job` placing the driver."""
    return {
        "entrypoint_num_cpus": 0,
        "entrypoint_num_gpus": 0,
        "entrypoint_resources": {HEAD_NODE_RESOURCE: 0.001},
    }


@dataclass
class Package:
    """The files that make up a working_dir, relative to `root`."""

    root: Path
    files: list[tuple[str, int]] = field(default_factory=list)  # (relative path, bytes)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    def largest_entries(self, n: int = 5) -> list[tuple[str, int]]:
        """Top-level files/directories by total size, largest first."""
        sizes: dict[str, int] = {}
        for rel, size in self.files:
            top = rel.split("/", 1)[0] + ("/" if "/" in rel else "")
            sizes[top] = sizes.get(top, 0) + size
        return sorted(sizes.items(), key=lambda kv: -kv[1])[:n]


def exclude_patterns(repo: Path, extra_paths: Iterable[str | Path] = ()) -> list[str]:
    """The gitignore-style patterns for the repo: the fixed lists, plus any of
    `extra_paths` (configured data and runs locations) that lie inside the repo."""
    patterns = [*EXCLUDE_ANYWHERE, *EXCLUDE_AT_ROOT]
    for p in extra_paths:
        # None: outside the repo, or in object storage: never part of the working_dir
        rel = locate(p, base_dir=repo).below(repo)
        if rel not in (None, "."):
            patterns.append(f"/{rel}/")
    return patterns


def collect(repo: str | Path, patterns: list[str]) -> Package:
    """Walk the repo and list what the working_dir would contain."""
    import pathspec

    root = Path(repo).resolve()
    spec = pathspec.GitIgnoreSpec.from_lines(patterns)
    pkg = Package(root=root)
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = sorted(d for d in dirnames if not spec.match_file(f"{prefix}{d}/"))
        for name in sorted(filenames):
            rel = prefix + name
            full = Path(dirpath) / name
            if spec.match_file(rel) or not full.is_file():
                continue  # excluded, or a broken symlink / socket
            pkg.files.append((rel, full.stat().st_size))
    return pkg


def check_size(pkg: Package, limit: int | None = None) -> None:
    """Refuse a working_dir Ray would refuse, naming what makes it large."""
    limit = max_package_bytes() if limit is None else limit
    total = pkg.total_bytes
    if total <= limit:
        return
    biggest = ", ".join(f"{name} {_mib(size)}" for name, size in pkg.largest_entries())
    raise UserError(
        f"working_dir {pkg.root} is {_mib(total)}, over Ray's upload limit of {_mib(limit)}; "
        f"largest entries: {biggest}. Move data and outputs under data/ or runs/ "
        "(never uploaded) or list them in a .rayignore"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def stage(pkg: Package, dest: str | Path) -> Path:
    """Copy the package's files into `dest` (created), preserving relative paths."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for rel, _ in pkg.files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pkg.root / rel, target)
    return dest


def library_dir() -> Path:
    """The directory of the trainlab package being run (shipped as a py_module)."""
    import trainlab

    return Path(trainlab.__file__).resolve().parent


def forwarded_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the job: the non-secret settings set here, then `extra`.

    The job's runtime env is shown to anyone who can list the cluster's jobs
    (`ray job list`, the dashboard): a setting that embeds credentials (e.g.
    `MLFLOW_TRACKING_URI=https://user:pass@host`) is refused, naming the variable
    and where credentials go instead; its value is never printed."""
    from trainlab.redact import is_secret_name, url_credentials

    env = {k: os.environ[k] for k in FORWARDED_ENV_VARS if os.environ.get(k)}
    env |= image_env()
    env.update(extra or {})
    leaking = sorted(k for k, v in env.items() if is_secret_name(k) or url_credentials(v))
    if leaking:
        raise UserError(
            f"{', '.join(leaking)} embeds credentials, which the job's runtime env would "
            "show to anyone who can list the cluster's jobs: use a URL without them and "
            "give the credentials to the cluster's nodes in their own environment "
            "(MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN, "
            "AWS_* variables or an instance role; docs/security.md)"
        )
    return env


def image_env() -> dict[str, str]:
    """`TRAINLAB_IMAGE=trainlab:<tag>`: the cluster image of this checkout's lock
    (trainlab.envlock.image_tag), recorded with the job's runs; {} without a lock."""
    from trainlab.envlock import image_tag

    try:
        return {IMAGE_ENV: f"trainlab:{image_tag('cuda')}"}
    except UserError:
        return {}


def build_runtime_env(
    working_dir: str | Path, *, ship_library: bool = True, env_vars: dict[str, str] | None = None
) -> dict[str, Any]:
    """The `runtime_env` dict for `submit_job` from an already staged working_dir."""
    runtime_env: dict[str, Any] = {
        "working_dir": str(working_dir),
        "excludes": list(PY_MODULE_EXCLUDES),
    }
    if ship_library:
        runtime_env["py_modules"] = [str(library_dir())]
    if env_vars:
        runtime_env["env_vars"] = dict(env_vars)
    return runtime_env
