"""`train.components` paths are checked at validation without importing anything:
the module is found by its files on the Python path, so reading a config never
runs the code of a package it names (docs/security.md)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import RECIPES
from trainlab.config import load_config
from trainlab.errors import ConfigError

PLANT = "import pathlib\npathlib.Path({marker!r}).touch()\n"


@pytest.fixture
def planted(tmp_path: Path, monkeypatch) -> tuple[str, Path]:
    """A package on sys.path whose every module, imported, touches a marker file:
    {name}/__init__.py, {name}/mod.py, {name}/sub/__init__.py, {name}/sub/deep.py,
    and {name}/space/leaf.py in a namespace package (no __init__.py)."""
    name = f"planted_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "code-ran"
    code = PLANT.format(marker=str(marker)) + "def factory(cfg):\n    return []\n"
    for rel in ("__init__.py", "mod.py", "sub/__init__.py", "sub/deep.py", "space/leaf.py"):
        path = tmp_path / "site" / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield name, marker
    for module in [m for m in sys.modules if m.split(".")[0] == name]:
        del sys.modules[module]


def config_with(tmp_path: Path, *components: str) -> Path:
    config = tmp_path / "exp.yaml"
    listed = ", ".join(repr(c) for c in components)
    config.write_text(f"extends: {RECIPES / 'tiny.yaml'}\ntrain: {{components: [{listed}]}}\n")
    return config


def test_validating_component_paths_imports_nothing(tmp_path, planted):
    name, marker = planted
    paths = [f"{name}.mod:factory", f"{name}.sub.deep:factory", f"{name}.space.leaf:factory"]
    cfg = load_config(config_with(tmp_path, *paths))
    assert list(cfg.train.components) == paths
    assert not marker.exists(), "validation ran the package's code"
    assert not [m for m in sys.modules if m.split(".")[0] == name]


@pytest.mark.parametrize("missing", ["{name}.nope", "{name}.sub.nope", "nowhere_{name}.mod"])
def test_a_missing_component_module_is_still_reported(tmp_path, planted, missing):
    name, marker = planted
    module = missing.format(name=name)
    with pytest.raises(ConfigError) as e:
        load_config(config_with(tmp_path, f"{module}:factory"))
    assert any(f"no module {module!r} on the Python path" in line for line in e.value.lines)
    assert not marker.exists()


def test_an_imported_or_installed_module_is_found(tmp_path):
    # trainlab's own (imported) and an installed one not imported by the test.
    paths = ["trainlab.train.loop.components:build_components", "email.mime.text:MIMEText"]
    cfg = load_config(config_with(tmp_path, *paths))
    assert list(cfg.train.components) == paths
