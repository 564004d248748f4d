"""The library's import graph: no cycles between packages or between files, and
the layers stay apart (training does not import the experiment record).

Every `import` statement counts, also those inside functions (a lazy import
still ties the two parts together). Run this file alone to check after a change:
`.venv/bin/pytest tests/unit/test_import_graph.py`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO

SOURCE_ROOT = REPO / "platform"


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in (SOURCE_ROOT / "trainlab").rglob("*.py"):
        parts = list(path.relative_to(SOURCE_ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the trainlab modules it imports. `from pkg import name` points at
    pkg.name when that is a module, else at pkg; a module's own parent packages
    (imported implicitly by Python) are not edges."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {t for a in node.names if (t := owner(a.name))}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                if not base.startswith("trainlab"):
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    target = full if full in modules else owner(base)
                    if target:
                        edges.add(target)
        graph[name] = {t for t in edges if t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_of(module: str) -> str:
    """trainlab.train.checkpoint -> trainlab.train; trainlab.errors -> trainlab.errors."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycles_between_files():
    assert cycles(import_graph()) == []


def test_no_import_cycles_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        src = package_of(module)
        packages.setdefault(src, set()).update(
            package_of(t) for t in targets if package_of(t) != src and t != "trainlab"
        )
    assert cycles(packages) == []


def test_training_layer_does_not_import_tracking():
    graph = import_graph()
    offenders = {
        f"{m} -> {t}"
        for m, targets in graph.items()
        if package_of(m) == "trainlab.train"
        for t in targets
        if package_of(t) in ("trainlab.track", "trainlab.monitor")
    }
    assert offenders == set()


def test_importing_training_loads_neither_tracking_nor_mlflow():
    """A fresh interpreter: importing the training layer (its driver, its worker
    entry, the trainer) pulls in no experiment-record code."""
    code = textwrap.dedent(
        """
        import sys
        import trainlab.train
        import trainlab.train.driver.launcher, trainlab.train.loop.trainer, trainlab.train.driver.worker
        bad = sorted(m for m in sys.modules
                     if m == "mlflow" or m.startswith(("mlflow.", "trainlab.track",
                                                       "trainlab.monitor")))
        print(",".join(bad))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.strip() == "", out.stdout


def test_the_run_package_sits_below_training():
    """trainlab.run (a run's directory, lock, records) is below the execution layer
    and the commands: nothing in it imports them, not even lazily."""
    above = ("trainlab.train", "trainlab.cli", "trainlab.track", "trainlab.monitor")
    offenders = {
        f"{m} -> {t}"
        for m, targets in import_graph().items()
        if package_of(m) == "trainlab.run"
        for t in targets
        if package_of(t) in above
    }
    assert offenders == set()


def test_importing_the_run_package_loads_neither_torch_nor_ray():
    """A fresh interpreter: a run's records, lock, directory, location and
    checkpoints (their catalog, local or in a store) are read by commands that must
    start fast (gc, jobs, track) without torch or Ray."""
    code = textwrap.dedent(
        """
        import sys
        import trainlab.run.records, trainlab.run.lock, trainlab.run.dir, trainlab.run.location
        import trainlab.run.checkpoints, trainlab.run.checkpoints.names
        import trainlab.run.checkpoints.info, trainlab.run.checkpoints.validation
        import trainlab.run.checkpoints.local, trainlab.run.checkpoints.store
        bad = sorted(m for m in sys.modules
                     if m in ("torch", "ray") or m.startswith(("torch.", "ray.")))
        print(",".join(bad))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.strip() == "", out.stdout


def test_the_library_does_not_import_the_repo_tools():
    """devtools/ (benchmarks, the demo driver, test datasets) is not installed."""
    graph = import_graph()
    offenders = set()
    for module, (path, _) in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            offenders |= {
                f"{module} -> {n}" for n in names if n.split(".")[0] in ("devtools", "tests")
            }
    assert graph and offenders == set()


# The execution layer's roles, from the driver down: each imports only the ones
# after it (platform/trainlab/train/__init__.py draws the tree).
TRAIN_LAYERS = (
    "driver",
    "supervision",
    "loop",
    "summaries",
    ("job", "parallel", "checkpoint"),
)


def test_the_execution_layers_roles_import_downwards_only():
    rank = {}
    for i, layer in enumerate(TRAIN_LAYERS):
        for name in (layer,) if isinstance(layer, str) else layer:
            rank[f"trainlab.train.{name}"] = i

    def role(module: str) -> str | None:
        parts = module.split(".")
        name = ".".join(parts[:3])
        return name if name in rank else None

    offenders = set()
    for module, targets in import_graph().items():
        src = role(module)
        for target in targets:
            dst = role(target)
            if src and dst and src != dst and rank[dst] <= rank[src]:
                offenders.add(f"{module} -> {target}")
    assert offenders == set()
