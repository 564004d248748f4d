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
    with pytest.raises(ValueError, match=r"unknown attention; available: auto, eager, flex, sdpa"):
        small("llama", attention="nope")
    unchecked = small("llama").model_copy(update={"attention": "nope"})
    with pytest.raises(UserError, match=r"model.attention = 'nope'.*auto, eager, flex, sdpa"):
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


def _packed_rows(vocab: int, rows: int = 3, seq_len: int = 300) -> dict[str, torch.Tensor]:
    """Rows of several documents each (and padding), longer than one 128-token block:
    FlexAttention skips whole blocks and masks inside the others."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (rows, seq_len), generator=g)
    documents = torch.full((rows, seq_len), -1, dtype=torch.int32)
    positions = torch.zeros((rows, seq_len), dtype=torch.long)
    for r in range(rows):
        at, doc = 0, 0
        while at < seq_len - 20:
            n = int(torch.randint(5, 160, (1,), generator=g))
            n = min(n, seq_len - 20 - at)
            documents[r, at : at + n] = doc
            positions[r, at : at + n] = torch.arange(n)
            at, doc = at + n, doc + 1
    return {"input_ids": ids, "position_ids": positions, "document_ids": documents}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_flex_gives_the_logits_of_sdpa_for_packed_rows(arch):
    """FlexAttention's block mask (forward on CPU, under no_grad) against SDPA's dense
    mask: the same model, the same packed rows, fp32."""
    batch = _packed_rows(97)
    torch.manual_seed(0)
    sdpa = build_model(small(arch, attention="sdpa", max_seq_len=512)).eval()
    torch.manual_seed(0)
    flex = build_model(small(arch, attention="flex", max_seq_len=512)).eval()
    with torch.no_grad():
        want, got = sdpa(**batch), flex(**batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The block mask skips blocks: some pairs of 128-token blocks have nothing to see.
    from trainlab.models.attention import prepare_mask

    mask = prepare_mask("flex", 300, batch["document_ids"], torch.device("cpu"))
    assert mask._dense is None  # no [T, T] tensor on the flex path
    blocks = mask.block()
    assert blocks.sparsity() > 0


def test_auto_is_sdpa_on_cpu_and_flex_on_cuda():
    from trainlab.models.registry import resolve_attention

    assert resolve_attention("auto", cuda=False) == "sdpa"
    assert resolve_attention("auto", cuda=True) == "flex"
    assert resolve_attention("auto", cuda=True, dropout=0.1) == "sdpa"
    assert resolve_attention("eager", cuda=True) == "eager"
    batch = _packed_rows(97, rows=1, seq_len=40)
    torch.manual_seed(0)
    auto = build_model(small("llama")).eval()  # auto: the default
    torch.manual_seed(0)
    sdpa = build_model(small("llama", attention="sdpa")).eval()
    torch.testing.assert_close(auto(**batch), sdpa(**batch), rtol=0, atol=0)
