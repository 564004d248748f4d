"""What a malicious config or checkpoint file cannot do (docs/security.md): run
code when read. Configs are read with yaml.safe_load; checkpoint files with
torch.load(weights_only=True)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from trainlab.config import load_config
from trainlab.errors import UserError
from trainlab.train import checkpoint as ck


class _Planted:
    """Unpickling this calls Path.touch(marker): code execution by loading a file."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_a_checkpoint_file_cannot_run_code_when_loaded(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "model.pt"
    torch.save({"weight": torch.zeros(2), "payload": _Planted(marker)}, path)
    with pytest.raises(Exception, match="(?i)weights_only|unsupported global"):
        ck.load_file(path)
    assert not marker.exists()


def test_a_config_cannot_run_code_when_read(tmp_path):
    marker = tmp_path / "code-ran"
    config = tmp_path / "exp.yaml"
    config.write_text(f'name: !!python/object/apply:pathlib.Path.touch ["{marker}"]\n')
    with pytest.raises(UserError, match="invalid YAML"):
        load_config(config)
    assert not marker.exists()
