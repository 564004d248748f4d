"""The worked user architecture (trainers/models/parallel_alibi.py) keeps trainlab's
model contract: packed documents see only themselves, it builds and runs on the meta
device (where trainlab measures it), its options are checked, and it exports."""

from __future__ import annotations

import importlib.util
import json
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from tests.conftest import REPO

EXAMPLE = REPO / "trainers" / "models" / "parallel_alibi.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    # Under a name of its own: trainlab imports the same file as `parallel_alibi`.
    spec = importlib.util.spec_from_file_location("trainers_example_parallel_alibi", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def section(**kw) -> SimpleNamespace:
    """A stand-in for the config's model section."""
    fields = {
        "vocab_size": 97, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "ffn_hidden_size": 64, "max_seq_len": 64,
        "tie_embeddings": True, "norm_eps": 1e-5, "rope_theta": 10000.0,
        "init_std": 0.02, "dropout": 0.0, "attention": "auto", "options": {},
        "cross_document_attention": False,
    }  # fmt: skip
    return SimpleNamespace(**{**fields, **kw})


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"tie_embeddings": False, "num_kv_heads": 4},
        {"options": {"parallel_residual": False, "norm": "rms", "alibi_max_bias": 4.0}},
    ],
)
def test_packed_documents_see_only_themselves(example, kw):
    torch.manual_seed(0)
    model = example.ParallelAlibi().build(section(**kw)).eval()
    lengths = [9, 13]
    ids = torch.randint(1, 97, (1, sum(lengths) + 3))  # two documents, then padding
    docs = torch.tensor([[0] * 9 + [1] * 13 + [-1] * 3])
    pos = torch.cat([torch.arange(9), torch.arange(13), torch.zeros(3, dtype=torch.long)])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=pos, document_ids=docs)
        for start, n in ((0, 9), (9, 13)):
            alone = model(
                ids[:, start : start + n],
                position_ids=torch.arange(n)[None],
                document_ids=torch.zeros(1, n, dtype=torch.long),
            )
            assert (packed[:, start : start + n] - alone).abs().max() < 1e-5
        # No document ids: plain causal attention, the same as one document.
        plain = model(ids[:, 9:22])
        assert (packed[:, 9:22] - plain).abs().max() < 1e-5
    assert packed.shape == (1, 25, 97)


def test_builds_and_trains_on_the_meta_device(example):
    from trainlab.models import repeated_blocks

    with torch.device("meta"):
        model = example.ParallelAlibi().build(section(options={"parallel_residual": False}))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert repeated_blocks(model) == list(model.layers)
    ids = torch.zeros((2, 16), dtype=torch.long, device="meta")
    docs = torch.zeros((2, 16), dtype=torch.int32, device="meta")
    pos = torch.arange(16, device="meta")[None].expand(2, 16)
    logits = model(ids, position_ids=pos, document_ids=docs)
    assert logits.shape == (2, 16, 97) and logits.device.type == "meta"
    logits.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_tied_embeddings_share_one_tensor(example):
    tied = example.ParallelAlibi().build(section())
    untied = example.ParallelAlibi().build(section(tie_embeddings=False))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert untied.output.weight is not untied.tok_embeddings.weight
    n = sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters())
    assert n == 97 * 32


@pytest.mark.parametrize(
    "options", [{"alibi_max_bias": 8.0, "unknown": 1}, {"alibi_max_bias": "steep"},
                {"parallel_residual": "sometimes"}, {"norm": "batch"}],
)  # fmt: skip
def test_options_are_checked(example, options):
    options_model = example.ParallelAlibi.options_model
    with pytest.raises(ValidationError):
        options_model.model_validate(options)
    with pytest.raises(ValidationError):
        example.ParallelAlibi().build(section(options=options))


def test_options_change_the_model(example):
    arch = example.ParallelAlibi()
    assert arch.isolates_documents({}) is None
    ids = torch.randint(1, 97, (1, 12))
    out = {}
    for bias in (1.0, 8.0):
        torch.manual_seed(0)
        out[bias] = arch.build(section(options={"alibi_max_bias": bias})).eval()(ids)
    assert (out[1.0] - out[8.0]).abs().max() > 1e-6
    sequential = arch.build(section(options={"parallel_residual": False}))
    assert sum(p.numel() for p in sequential.parameters()) > sum(
        p.numel() for p in arch.build(section()).parameters()
    )  # a second norm per block


def test_export_writes_weights_once_and_the_section(example, tmp_path):
    from safetensors.torch import load_file

    arch = example.ParallelAlibi()
    model = arch.build(section(options={"alibi_max_bias": 4.0}))
    arch.export(model, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert "output.weight" not in tensors  # tied: stored as the embedding
    state = model.state_dict()
    assert set(tensors) == set(state) - {"output.weight"}
    assert all(torch.equal(tensors[k], state[k]) for k in tensors)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["hidden_size"] == 32 and config["options"]["alibi_max_bias"] == 4.0
