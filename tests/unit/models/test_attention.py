"""The attention registry: names, errors, one-file variants."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.unit.models.common import small
from trainlab.errors import UserError
from trainlab.models import attention as attention_pkg
from trainlab.models import build_model


def test_unknown_attention_is_a_user_error_naming_the_choices():
    # The config refuses it at validation now (torch-free); a model section that
    # skipped validation still gets the error naming the choices when built.
    with pytest.raises(ValueError, match=r"unknown attention; available: eager, sdpa"):
        small("llama", attention="nope")
    unchecked = small("llama").model_copy(update={"attention": "nope"})
    with pytest.raises(UserError, match=r"model.attention = 'nope'.*eager, sdpa"):
        build_model(unchecked)


def test_a_new_attention_variant_is_one_file(tmp_path, monkeypatch):
    """Dropping a module with @register into the package is all it takes."""
    (tmp_path / "scaled_eager.py").write_text(
        "from trainlab.models.attention import register\n"
        "from trainlab.models.attention.eager import eager_attention\n\n"
        "@register('scaled_eager')\n"
        "def scaled(q, k, v, mask, dropout_p=0.0):\n"
        "    return eager_attention(q, k, v, mask, dropout_p)\n"
    )
    monkeypatch.setattr(attention_pkg, "__path__", [*attention_pkg.__path__, str(tmp_path)])
    monkeypatch.setattr(attention_pkg, "_discovered", False)
    monkeypatch.setattr(attention_pkg, "_REGISTRY", dict(attention_pkg._REGISTRY))
    monkeypatch.delitem(sys.modules, "trainlab.models.attention.scaled_eager", raising=False)
    assert "scaled_eager" in attention_pkg.available()
    model = build_model(small("gpt2", attention="scaled_eager"))
    assert model(torch.randint(0, 97, (1, 8))).shape == (1, 8, 97)
