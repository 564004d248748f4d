"""The model: exact parameter counts, packed-row attention, the attention registry."""

from __future__ import annotations

import sys

import pytest
import torch

from trainlab.config.schema import ModelConfig
from trainlab.errors import UserError
from trainlab.models import attention as attention_pkg
from trainlab.models import build_model, num_parameters, segment_positions
from trainlab.plan import count_params


def small(arch: str, **kw) -> ModelConfig:
    base = {
        "arch": arch,
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "vocab_size": 97,
        "max_seq_len": 64,
    }
    if arch == "llama":
        base["num_kv_heads"] = 2
    return ModelConfig.model_validate({**base, **kw})


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_matches_the_planner(arch, tie):
    cfg = small(arch, tie_embeddings=tie, ffn_hidden_size=48)
    assert num_parameters(build_model(cfg)) == count_params(cfg).total


def test_parameter_count_matches_with_default_ffn_and_plain_mha():
    cfg = small("llama", num_kv_heads=None, hidden_size=48, num_heads=3, tie_embeddings=False)
    assert num_parameters(build_model(cfg)) == count_params(cfg).total


def test_families_differ_as_documented():
    gpt2, llama = build_model(small("gpt2")), build_model(small("llama"))
    assert gpt2.pos_embeddings is not None and llama.pos_embeddings is None
    assert isinstance(gpt2.norm, torch.nn.LayerNorm)
    assert not any(name.endswith("bias") for name, _ in llama.named_parameters())
    assert gpt2.layers[0].attn.qkv.bias is not None


def test_tied_embeddings_share_one_tensor():
    model = build_model(small("llama", tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight


def test_segment_positions_restart_at_each_document():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1]])
    assert segment_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


def packed_row(vocab: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], list[slice]]:
    """One row in the contract format: a document continued from an earlier row
    (positions start at 11), two whole documents, then padding."""
    g = torch.Generator().manual_seed(seed)
    lengths, starts = [6, 5, 7], [11, 0, 0]
    seq_len = sum(lengths) + 4
    ids = torch.randint(1, vocab, (1, seq_len), generator=g)
    ids[0, sum(lengths) :] = 0  # padding is the EOS id
    positions = torch.zeros(1, seq_len, dtype=torch.long)
    documents = torch.full((1, seq_len), -1, dtype=torch.int32)
    segments, at = [], 0
    for doc, (n, first) in enumerate(zip(lengths, starts, strict=True)):
        positions[0, at : at + n] = torch.arange(first, first + n)
        documents[0, at : at + n] = doc
        segments.append(slice(at, at + n))
        at += n
    batch = {"input_ids": ids, "position_ids": positions, "document_ids": documents}
    return batch, segments


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logits_equal_each_document_alone(arch, attention):
    torch.manual_seed(0)
    model = build_model(small(arch, attention=attention)).eval()
    batch, segments = packed_row(model.cfg.vocab_size)
    with torch.no_grad():
        packed = model(**batch)
        for seg in segments:
            alone = model(batch["input_ids"][:, seg], position_ids=batch["position_ids"][:, seg])
            torch.testing.assert_close(packed[:, seg], alone, rtol=1e-4, atol=1e-5)


def test_packed_logits_differ_without_the_document_mask():
    """Guards the test above: without document_ids the second document sees the first."""
    torch.manual_seed(0)
    model = build_model(small("llama")).eval()
    batch, segments = packed_row(model.cfg.vocab_size)
    with torch.no_grad():
        masked = model(**batch)
        unmasked = model(batch["input_ids"], position_ids=batch["position_ids"])
    assert not torch.allclose(masked[:, segments[1]], unmasked[:, segments[1]], atol=1e-3)


def test_rope_depends_only_on_relative_positions():
    torch.manual_seed(0)
    model = build_model(small("llama")).eval()
    ids = torch.randint(0, 97, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, position_ids=pos), model(ids, position_ids=pos + 37), rtol=1e-4, atol=1e-5
        )


def test_sdpa_matches_eager_with_grouped_query_attention():
    torch.manual_seed(0)
    cfg = small("llama", num_heads=4, num_kv_heads=1)
    sdpa = build_model(cfg).eval()
    eager = build_model(cfg.model_copy(update={"attention": "eager"})).eval()
    eager.load_state_dict(sdpa.state_dict())
    batch, _ = packed_row(cfg.vocab_size, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(sdpa(**batch), eager(**batch), rtol=1e-4, atol=1e-5)


def test_unknown_attention_is_a_user_error_naming_the_choices():
    with pytest.raises(UserError, match=r"model.attention = 'nope'.*eager, sdpa"):
        build_model(small("llama", attention="nope"))


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


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_real_packed_batch_logits_equal_each_document_alone(arch, tmp_path_factory):
    """The same check on rows packed by trainlab.data from a real prepared dataset:
    several documents per row, continuations of split documents, padding."""
    from tests.train_helpers import dataset_dir, tiny_config
    from trainlab.data import WorkerLoader, prepare_run_data

    cfg = tiny_config(
        dataset_dir(tmp_path_factory),
        data={"seq_len": 64, "micro_batch_size": 8, "mix": {"code": 0.5, "docs": 0.5}},
    )
    ((_, micro_batches),) = WorkerLoader(prepare_run_data(cfg), 0, 1, backend="local").iter_from(
        3, 4
    )
    batch = {k: torch.as_tensor(v) for k, v in micro_batches[0].items()}
    torch.manual_seed(0)
    model = build_model(small(arch, vocab_size=1024, max_seq_len=64)).eval()
    seen = {"segments": 0, "continuations": 0, "rows_with_several": 0}
    with torch.no_grad():
        packed = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
        for row in range(batch["input_ids"].shape[0]):
            docs = batch["document_ids"][row]
            ids = [d for d in docs.unique().tolist() if d >= 0]
            seen["rows_with_several"] += len(ids) > 1
            for doc in ids:
                (where,) = (docs == doc).nonzero(as_tuple=True)
                seg = slice(int(where[0]), int(where[-1]) + 1)
                positions = batch["position_ids"][row : row + 1, seg]
                alone = model(batch["input_ids"][row : row + 1, seg], position_ids=positions)
                torch.testing.assert_close(packed[row : row + 1, seg], alone, rtol=1e-4, atol=1e-5)
                seen["segments"] += 1
                seen["continuations"] += int(positions[0, 0]) > 0
    assert seen["rows_with_several"] and seen["continuations"], seen
