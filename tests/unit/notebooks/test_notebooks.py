"""Every notebook in notebooks/ runs top to bottom in a real Jupyter kernel
(nbclient, the project's interpreter) against a small real store, with no cell
error; outputs are stripped in Git. Parameters reach the notebooks through the
environment variables their first cell reads (docs/notebooks.md)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.unit.notebooks.real_store import RUN_NAME, real_store

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def _env(path: Path, store) -> dict[str, str]:
    """The kernel's environment: the store's paths through the notebooks' parameters."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env |= {
        "TRAINLAB_RUNS_ROOT": str(store.runs_root),
        "TRAINLAB_DATA": str(store.dataset),
        "TRAINLAB_STEPS": "12",
        "TRAINLAB_EXPERIMENT": "notebooks",
    }
    if path.name == "explore_data.ipynb":  # replay the store run's own stream
        env["TRAINLAB_CONFIG"] = str(store.run_dir / "config.yaml")
    if path.name == "mixture_search.ipynb":  # a swarm record with a known law (no training)
        from tests.unit.mix.synthetic import make_record

        env["TRAINLAB_RUNS_ROOT"] = make_record(Path(store.runs_root).parent / "mixture")["runs_root"]
    return env


async def _execute(path: Path, store):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    await client.async_execute(env=_env(path, store))  # CellExecutionError on a failing cell
    return nb


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Every notebook run in its own kernel, all at once (kernels start and import
    in parallel); a notebook's result is its executed copy or its error."""
    store = real_store(tmp_path_factory)

    async def run_all():
        return await asyncio.gather(*(_execute(p, store) for p in NOTEBOOKS), return_exceptions=True)

    return dict(zip([p.name for p in NOTEBOOKS], asyncio.run(run_all()), strict=True))


def test_the_notebooks_are_there_and_stripped():
    assert {p.name for p in NOTEBOOKS} >= {
        "explore_data.ipynb",
        "plan_layouts.ipynb",
        "compare_runs.ipynb",
        "mix_search.ipynb",
        "mixture_search.ipynb",
    }
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        assert nb["nbformat"] == 4 and nb["metadata"]["kernelspec"]["name"] == "python3"
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, path.name
        first = next(c for c in nb["cells"] if c["cell_type"] == "code")
        assert "parameters" in first["metadata"].get("tags", []), path.name


def _text(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.append(o.get("text", ""))
            out.extend(str(v) for k, v in o.get("data", {}).items() if k.startswith("text/"))
    return "\n".join(out)


# What each notebook must show of the store (besides running without error):
# texts in its outputs, and how many figures at least.
EXPECT = {
    "compare_runs.ipynb": ([RUN_NAME, "1 run(s)", "no group recorded"], 2),  # curves, shares
    "explore_data.ipynb": (["docs_out", "step 0, row 0", "[doc 0]"], 2),  # lengths, shares
    "plan_layouts.ipynb": (["GiB_per_device", "7B", "layout tp=1"], 1),  # memory bars
    "mix_search.ipynb": (["1 run(s) of 'notebooks'; best val_loss", "share.code"], 1),
    "mixture_search.ipynb": (["swarm 0123abcd: 24 trials", "best model:", "proposal:"], 2),
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_a_kernel(path: Path, executed):
    nb = executed[path.name]
    if isinstance(nb, BaseException):
        raise nb
    text = _text(nb)
    needles, figures = EXPECT.get(path.name, ([], 0))
    for needle in needles:
        assert needle in text, f"{path.name}: {needle!r} not in its outputs"
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= figures, path.name
