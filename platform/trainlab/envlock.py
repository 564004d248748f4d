"""The software a run ran with, the lock it should match, and the check of every node.

One environment everywhere: requirements/NAME.txt (devtools/lock.py, `make lock`)
pins every package for each platform: `cpu` (torch's CPU build: this machine,
CI) and `cuda` (GPU nodes, the cluster image). A process's platform is the
lock it belongs to: `cuda` when its torch is a CUDA build, else `cpu`.

- `fingerprint()`: this process's environment, cheap (no torch import: versions
  from the installed distributions, CUDA from torch/version.py, cuDNN and NCCL
  from their nvidia-* wheels, the accelerator from nvidia-smi).
- `check_nodes()`: before a run starts, one small Ray task per alive node asks
  for its fingerprint; every runtime package (trainlab's requirements and theirs)
  must have the version the lock of that node's platform names. A node that
  differs stops the run (`UserError`, one line per node and package) unless
  drift is allowed (`--allow-env-drift`), when the drift is recorded.
- `write_run_environment()` / `run_environment()`: the run's record of it,
  `environment.json` in the run directory (what run_summary.json's `environment`
  and the MLflow run's `env.*` tags hold) and `environment-packages.txt` (every
  installed package, logged as an artifact).

The lock files are found in TRAINLAB_LOCK_DIR, else requirements/ of the current
directory (a submitted job runs in a copy of the submitter's checkout), else of
the checkout trainlab was installed from, else of TRAINLAB_REPO (the image).
Without any, the driver's own versions are the reference and the lines say so.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from trainlab.errors import UserError

LOCK_DIR_ENV = "TRAINLAB_LOCK_DIR"
ALLOW_DRIFT_ENV = "TRAINLAB_ALLOW_ENV_DRIFT"
ENV_FILE = "environment.json"
PACKAGES_FILE = "environment-packages.txt"
LOCKS = ("cpu", "cuda")
NODE_TIMEOUT_S = 120.0
# What run_summary.json and the MLflow tags carry (the package list goes to a file).
SUMMARY_KEYS = (
    "python",
    "platform",
    "torch",
    "cuda",
    "cudnn",
    "nccl",
    "ray",
    "mlflow",
    "trainlab",
    "git_commit",
    "git_dirty",
    "lock",
    "lock_sha256",
    "accelerator",
    "accelerator_driver",
    "packages_sha256",
    "nodes",
    "drift",
    "image",
)
_REQ_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)")
_LOCAL_PACKAGE_REPO = Path(__file__).resolve().parents[2]


def canonical(name: str) -> str:
    """A distribution name as PEP 503 normalizes it (Foo_Bar -> foo-bar)."""
    return re.sub(r"[-_.]+", "-", name).lower()


# --------------------------------------------------------------------------- locks


def lock_dir() -> Path | None:
    """The directory holding requirements/{cpu,cuda}.txt (see the module doc)."""
    candidates = [os.environ.get(LOCK_DIR_ENV)]
    candidates += [str(Path.cwd() / "requirements"), str(_LOCAL_PACKAGE_REPO / "requirements")]
    if os.environ.get("TRAINLAB_REPO"):
        candidates.append(str(Path(os.environ["TRAINLAB_REPO"]) / "requirements"))
    for c in candidates:
        if c and any((Path(c) / f"{name}.txt").is_file() for name in LOCKS):
            return Path(c)
    return None


def read_lock(path: str | Path) -> dict[str, str]:
    """{canonical name: version} of a pip requirements lock (`name==version` lines)."""
    pins: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        m = _REQ_NAME.match(line.strip())
        if m:
            pins[canonical(m.group(1))] = m.group(3)
    return pins


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def lock_path(name: str) -> Path | None:
    where = lock_dir()
    path = where / f"{name}.txt" if where else None
    return path if path is not None and path.is_file() else None


def image_tag(name: str = "cuda") -> str:
    """The cluster image's tag: the lock it installs and the start of that lock's
    sha256 (`cuda-1a2b3c4d5e6f`): a dependency change is a new lock, so a new tag."""
    path = lock_path(name)
    if path is None:
        raise UserError(f"requirements/{name}.txt: not found (make lock writes it)")
    return f"{name}-{file_sha256(path)[:12]}"


# --------------------------------------------------------------------------- fingerprint


def installed() -> dict[str, str]:
    """{canonical name: version} of the distributions this interpreter imports:
    the first of each name along sys.path, as `importlib.metadata.version` finds it."""
    found: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonical(name), dist.version)
    return found


def runtime_names(packages: Mapping[str, str] | None = None) -> set[str]:
    """trainlab's requirements (not its extras) and theirs, transitively, as
    installed here: the packages a run imports. Dev tools (pytest, moto) are not."""
    names: set[str] = set()
    todo = ["trainlab"]
    while todo:
        name = todo.pop()
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for text in reqs:
            from packaging.requirements import Requirement

            req = Requirement(text)
            extras = set(req.extras)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            child = canonical(req.name)
            if child not in names:
                names.add(child)
                todo.append(child)
            for extra in extras:  # ray[default,train]: the extra's requirements too
                todo.extend(_extra_requirements(child, extra, names))
    return names


def _extra_requirements(name: str, extra: str, seen: set[str]) -> list[str]:
    from packaging.requirements import Requirement

    out = []
    try:
        reqs = md.requires(name) or []
    except md.PackageNotFoundError:
        return out
    for text in reqs:
        req = Requirement(text)
        if req.marker is None or not req.marker.evaluate({"extra": extra}):
            continue
        if req.marker.evaluate({"extra": ""}):
            continue  # not extra-specific: already followed
        child = canonical(req.name)
        if child not in seen:
            seen.add(child)
            out.append(child)
    return out


def _torch_cuda() -> str | None:
    """torch.version.cuda without importing torch (seconds on a cold node)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_py = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", version_py.read_text(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def _first(packages: Mapping[str, str], prefix: str) -> str | None:
    names = sorted(n for n in packages if n.startswith(prefix))
    return packages[names[0]] if names else None


def accelerator() -> tuple[str, str | None]:
    """(model, driver version) of this node's GPUs (`nvidia-smi`), else ("cpu", None)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
        except (OSError, subprocess.SubprocessError):
            out = None
        lines = [
            ln for ln in (out.stdout.splitlines() if out and out.returncode == 0 else []) if ln
        ]
        if lines:
            names = sorted({ln.split(",")[0].strip() for ln in lines})
            driver = lines[0].split(",")[-1].strip()
            return f"{len(lines)} x {' + '.join(names)}", driver
    return "cpu", None


def platform_lock(cuda: str | None) -> str:
    """The lock a process belongs to: `cuda` for a CUDA build of torch, else `cpu`."""
    return "cuda" if cuda else "cpu"


def fingerprint() -> dict[str, Any]:
    """This process's environment (node-level: no git, no run)."""
    import trainlab

    packages = installed()
    cuda = _torch_cuda()
    model, driver = accelerator()
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "torch": packages.get("torch"),
        "cuda": cuda,
        "cudnn": _first(packages, "nvidia-cudnn") if cuda else None,
        "nccl": _first(packages, "nvidia-nccl") if cuda else None,
        "ray": packages.get("ray"),
        "mlflow": packages.get("mlflow"),
        "trainlab": trainlab.__version__,
        "lock": platform_lock(cuda),
        # The cluster image a submitted job expects (trainlab.rayjobs.runtime_env.image_env).
        "image": os.environ.get("TRAINLAB_IMAGE"),
        "accelerator": model,
        "accelerator_driver": driver,
        "packages": packages,
        "packages_sha256": hashlib.sha256(
            json.dumps(packages, sort_keys=True).encode()
        ).hexdigest(),
    }


def drift(
    packages: Mapping[str, str], reference: Mapping[str, str], names: Iterable[str]
) -> list[tuple[str, str, str]]:
    """(package, installed or "not installed", reference version) for each of
    `names` the reference pins whose installed version differs."""
    out = []
    for name in sorted(set(names) & set(reference)):
        have = packages.get(name)
        if have != reference[name]:
            out.append((name, have or "not installed", reference[name]))
    return out


def local_drift() -> list[str]:
    """How this process's runtime packages differ from its platform's lock."""
    fp = fingerprint()
    path = lock_path(fp["lock"])
    if path is None:
        return []
    pkgs = fp["packages"]
    return [f"{n} {h} != {w} (lock)" for n, h, w in drift(pkgs, read_lock(path), runtime_names())]


# --------------------------------------------------------------------------- nodes


def _node_fingerprint() -> dict[str, Any]:
    import ray

    fp = fingerprint()
    fp["node_ip"] = ray.util.get_node_ip_address()
    fp["node_id"] = ray.get_runtime_context().get_node_id()
    return fp


def node_fingerprints(timeout_s: float = NODE_TIMEOUT_S) -> list[dict[str, Any]]:
    """One small task per alive node of the connected cluster (pinned to it, no
    CPU reserved), each returning that node's fingerprint."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(_node_fingerprint)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = {
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(): n
        for n in nodes
    }
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    out = []
    for ref in ready:
        try:
            out.append(ray.get(ref))
        except Exception as e:  # noqa: BLE001 - a node that cannot run the check is named
            n = refs[ref]
            out.append(
                {"node_ip": n["NodeManagerAddress"], "node_id": n["NodeID"], "error": str(e)}
            )
    for ref in pending:
        n = refs[ref]
        ray.cancel(ref, force=True)
        out.append(
            {
                "node_ip": n["NodeManagerAddress"],
                "node_id": n["NodeID"],
                "error": f"no answer within {timeout_s:.0f} s",
            }
        )
    return sorted(out, key=lambda f: (f["node_ip"], f["node_id"]))


def _node_label(fp: Mapping[str, Any], ambiguous: bool) -> str:
    """`node 10.0.0.7`; with the node id when several nodes share an address."""
    ip = fp.get("node_ip", "?")
    return f"node {ip} ({str(fp.get('node_id', ''))[:8]})" if ambiguous else f"node {ip}"


def node_drift(
    fingerprints: list[dict[str, Any]],
    names: Iterable[str],
    reference: Mapping[str, str] | None = None,
) -> list[str]:
    """One line per differing node and package, e.g. `node 10.0.0.7: torch 2.12.1
    != 2.13.0 (lock)`. Each node is held to the lock of its own platform; with no
    lock found, to `reference` (the driver's versions)."""
    names = set(names)
    ips = [fp.get("node_ip") for fp in fingerprints]
    locks: dict[str, dict[str, str]] = {}
    lines = []
    for fp in fingerprints:
        label = _node_label(fp, ips.count(fp.get("node_ip")) > 1)
        if "error" in fp:
            lines.append(f"{label}: the environment check failed: {fp['error']}")
            continue
        name = fp.get("lock", "cpu")
        if name not in locks:
            path = lock_path(name)
            locks[name] = read_lock(path) if path else {}
        pins, what = (locks[name], "lock") if locks[name] else (reference or {}, "driver")
        here = platform.python_version()
        if fp.get("python") and fp["python"].rsplit(".", 1)[0] != here.rsplit(".", 1)[0]:
            lines.append(f"{label}: python {fp['python']} != {here} (driver)")
        for pkg, have, want in drift(fp.get("packages", {}), pins, names):
            lines.append(f"{label}: {pkg} {have} != {want} ({what})")
    return lines


def check_nodes(run: Any = None, allow_drift: bool | None = None) -> list[str]:
    """Ask every node for its environment before any worker starts: a node whose
    runtime packages differ from its lock stops the run (UserError, exit 2), one
    line per node and package; with `allow_drift` (default: TRAINLAB_ALLOW_ENV_DRIFT)
    the lines are returned and recorded in the run's environment.json."""
    if allow_drift is None:
        allow_drift = os.environ.get(ALLOW_DRIFT_ENV, "") not in ("", "0", "false")
    fps = node_fingerprints()
    mine = installed()
    lines = node_drift(fps, runtime_names(), reference=mine)
    if lines and not allow_drift:
        raise UserError(
            [
                *lines,
                "the cluster's nodes must run the locked environment (requirements/*.txt; "
                "cluster/README.md): fix the node(s), or --allow-env-drift to run anyway "
                "(the drift is recorded)",
            ]
        )
    if run is not None:
        write_run_environment(run, nodes=fps, drift_lines=lines)
    return lines


# --------------------------------------------------------------------------- the run's record


def _git_info() -> dict[str, str]:
    """The code version as trainlab.track.gitinfo gives it to the MLflow run (the
    variables a submitted job carries, else git in the current directory, then in
    trainlab's checkout); read here too, so the environment imports no tracking."""
    if os.environ.get("TRAINLAB_GIT_COMMIT"):
        return {
            "commit": os.environ["TRAINLAB_GIT_COMMIT"],
            "dirty": os.environ.get("TRAINLAB_GIT_DIRTY", "unknown").lower(),
        }
    for where in (Path.cwd(), _LOCAL_PACKAGE_REPO):
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=where,
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
            status = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=where,
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        return {"commit": commit, "dirty": str(bool(status.strip())).lower()}
    return {"commit": "unknown", "dirty": "unknown"}


def run_fingerprint(
    nodes: list[dict[str, Any]] | None = None, drift_lines: list[str] | None = None
) -> dict[str, Any]:
    """This process's fingerprint plus git, the lock, and the nodes' summary."""
    fp = fingerprint()
    git = _git_info()
    path = lock_path(fp["lock"])
    fp |= {
        "git_commit": git["commit"],
        "git_dirty": {"true": True, "false": False}.get(git["dirty"]),
        "lock_sha256": file_sha256(path) if path else None,
    }
    if nodes:
        # The accelerators that train: the nodes' (the driver may sit on a CPU head).
        accels = sorted({n.get("accelerator") for n in nodes if n.get("accelerator")})
        gpus = [a for a in accels if a != "cpu"]
        fp["accelerator"] = ", ".join(gpus or accels) or fp["accelerator"]
        drivers = sorted({n["accelerator_driver"] for n in nodes if n.get("accelerator_driver")})
        fp["accelerator_driver"] = ", ".join(drivers) or fp["accelerator_driver"]
        fp["nodes"] = len(nodes)
    fp["drift"] = list(drift_lines or [])
    return fp


def _location(run: Any) -> Any:
    """The run at `run` (a path, a store URI or a RunLocation) as a RunLocation."""
    from trainlab.run.location import RunLocation

    return run if isinstance(run, RunLocation) else RunLocation.of(run)


def write_run_environment(
    run: Any,
    nodes: list[dict[str, Any]] | None = None,
    drift_lines: list[str] | None = None,
) -> dict[str, Any]:
    """environment.json (the summary) and environment-packages.txt of the run at
    `run` (a directory, a store URI or a RunLocation); returns the summary."""
    fp = run_fingerprint(nodes, drift_lines)
    loc = _location(run)
    packages = fp.pop("packages")
    loc.write_text(
        PACKAGES_FILE, "".join(f"{name}=={version}\n" for name, version in sorted(packages.items()))
    )
    summary = {k: fp.get(k) for k in SUMMARY_KEYS}
    loc.write_text(ENV_FILE, json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def run_environment(run: Any) -> dict[str, Any]:
    """The run's environment summary: environment.json as the driver wrote it
    (node check included); if it is not there, this process's own."""
    try:
        text = _location(run).read_text(ENV_FILE)
        if text:
            return json.loads(text)
    except (OSError, ValueError):
        pass
    fp = run_fingerprint()
    return {k: fp.get(k) for k in SUMMARY_KEYS}


def packages_file(run: Any) -> Path | None:
    """This node's copy of the run's environment-packages.txt (for an artifact)."""
    loc = _location(run)
    path = loc.local / PACKAGES_FILE
    if not path.is_file():
        text = loc.read_text(PACKAGES_FILE)
        if text is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


def mlflow_tags(env: Mapping[str, Any]) -> dict[str, str]:
    """`env.<key>` tags of an environment summary (None left out)."""
    tags = {}
    for key in SUMMARY_KEYS:
        value = env.get(key)
        if value is None or value == []:
            continue
        tags[f"env.{key}"] = "; ".join(value) if isinstance(value, list) else str(value)
    return tags


def main(argv: list[str] | None = None) -> int:
    """`python -m trainlab.envlock [image-tag [cpu|cuda] | check-lock]`: the image's
    tag, whether this environment is its lock (exit 1, one line per package), else
    this process's fingerprint as JSON."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["image-tag"]:
        print(image_tag(args[1] if len(args) > 1 else "cuda"))
        return 0
    if args[:1] == ["check-lock"]:  # cluster/Dockerfile: the image is its lock
        lines = local_drift()
        for line in lines:
            print(line, file=sys.stderr)
        return 1 if lines else 0
    fp = run_fingerprint()
    fp.pop("packages")
    print(json.dumps(fp, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
