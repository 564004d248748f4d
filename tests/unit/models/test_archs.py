"""The architectures: exact parameter counts, checkpoint names, what each family is."""

from __future__ import annotations

import pytest
import torch

from tests.unit.models.common import packed_row, small
from trainlab.models import build_model, num_parameters
from trainlab.models.registry import arch_names, get_arch
from trainlab.plan import count_params


@pytest.mark.parametrize("arch", arch_names())
@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_matches_the_planner(arch, tie):
    cfg = small(arch, tie_embeddings=tie, ffn_hidden_size=48)
    assert num_parameters(build_model(cfg)) == count_params(cfg).total


@pytest.mark.parametrize("arch", ["llama", "llama_qknorm"])
def test_parameter_count_matches_with_default_ffn_and_plain_mha(arch):
    cfg = small(arch, num_kv_heads=None, hidden_size=48, num_heads=3, tie_embeddings=False)
    assert num_parameters(build_model(cfg)) == count_params(cfg).total


@pytest.mark.parametrize("arch", arch_names())
def test_parameter_count_pieces_match_the_modules(arch):
    cfg = small(arch, tie_embeddings=False, num_layers=3)
    model, pc = build_model(cfg), count_params(cfg)
    assert num_parameters(model.layers[0]) == pc.per_layer
    assert num_parameters(model.layers) == pc.layers == 3 * pc.per_layer
    assert num_parameters(model.norm) == pc.final_norm
    assert model.output.weight.numel() == pc.head
    assert model.tok_embeddings.weight.numel() == pc.embedding
    positions = model.pos_embeddings.weight.numel() if model.pos_embeddings is not None else 0
    assert positions == pc.position
    assert get_arch(arch).learned_positions == (model.pos_embeddings is not None)


def test_families_differ_as_documented():
    gpt2, llama = build_model(small("gpt2")), build_model(small("llama"))
    assert gpt2.pos_embeddings is not None and llama.pos_embeddings is None
    assert isinstance(gpt2.norm, torch.nn.LayerNorm)
    assert not any(name.endswith("bias") for name, _ in llama.named_parameters())
    assert gpt2.layers[0].attn.q.bias is not None


def test_tied_embeddings_share_one_tensor():
    model = build_model(small("llama", tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("arch", arch_names())
def test_every_architecture_keeps_the_trainer_contract(arch):
    """What trainlab.train relies on: blocks in `.layers` (checkpointing and FSDP
    wrap each), `.tok_embeddings`, `.output`, and forward -> [B, T, V]."""
    cfg = small(arch)
    model = build_model(cfg)
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == cfg.num_layers
    assert isinstance(model.tok_embeddings, torch.nn.Embedding)
    assert isinstance(model.output, torch.nn.Linear)
    batch, _ = packed_row(cfg.vocab_size)
    assert model(**batch).shape == (1, batch["input_ids"].shape[1], cfg.vocab_size)
    assert model(batch["input_ids"]).shape == (1, batch["input_ids"].shape[1], cfg.vocab_size)


# The checkpoint contract: these names are what saved checkpoints hold.
GPT2_KEYS = [
    "tok_embeddings.weight", "pos_embeddings.weight",
    "layers.0.attn_norm.weight", "layers.0.attn_norm.bias",
    "layers.0.attn.q.weight", "layers.0.attn.q.bias",
    "layers.0.attn.k.weight", "layers.0.attn.k.bias",
    "layers.0.attn.v.weight", "layers.0.attn.v.bias",
    "layers.0.attn.out.weight", "layers.0.attn.out.bias",
    "layers.0.mlp_norm.weight", "layers.0.mlp_norm.bias",
    "layers.0.mlp.fc.weight", "layers.0.mlp.fc.bias",
    "layers.0.mlp.proj.weight", "layers.0.mlp.proj.bias",
    "norm.weight", "norm.bias", "output.weight",
]  # fmt: skip
LLAMA_KEYS = [
    "tok_embeddings.weight",
    "layers.0.attn_norm.weight", "layers.0.attn.q.weight", "layers.0.attn.k.weight",
    "layers.0.attn.v.weight", "layers.0.attn.out.weight",
    "layers.0.mlp_norm.weight",
    "layers.0.mlp.gate.weight", "layers.0.mlp.up.weight", "layers.0.mlp.proj.weight",
    "norm.weight", "output.weight",
]  # fmt: skip
QKNORM_KEYS = [
    *LLAMA_KEYS[:6], "layers.0.attn.q_norm.weight", "layers.0.attn.k_norm.weight",
    *LLAMA_KEYS[6:],
]  # fmt: skip


@pytest.mark.parametrize(
    "arch, keys", [("gpt2", GPT2_KEYS), ("llama", LLAMA_KEYS), ("llama_qknorm", QKNORM_KEYS)]
)
def test_state_dict_names_in_creation_order(arch, keys):
    model = build_model(small(arch, num_layers=1, tie_embeddings=False))
    assert list(model.state_dict()) == keys
    assert [name for name, _ in model.named_parameters()] == keys


# --------------------------------------------------------------------------- llama_qknorm


def test_qknorm_adds_two_head_dim_norms_per_layer():
    llama, qk = small("llama", tie_embeddings=False), small("llama_qknorm", tie_embeddings=False)
    extra = count_params(qk).total - count_params(llama).total
    assert extra == qk.num_layers * 2 * qk.head_dim
    model = build_model(qk)
    assert num_parameters(model) == count_params(qk).total
    assert model.layers[0].attn.q_norm.weight.shape == (qk.head_dim,)
    assert model.layers[0].attn.k_norm.weight.shape == (qk.head_dim,)


def test_qknorm_count_at_scale():
    """Qwen3-0.6B-like shapes: h=1024, L=28, a=16, kv=8, f=3072, V=151936, tied;
    head_dim here is hidden/heads = 64, so each layer adds 2*64 norm weights."""
    cfg = small(
        "llama_qknorm",
        hidden_size=1024,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        ffn_hidden_size=3072,
        vocab_size=151936,
        max_seq_len=4096,
    )
    h, kv_dim, f = 1024, 8 * 64, 3072
    per_layer = (2 * h * h + 2 * h * kv_dim) + 3 * h * f + 2 * h + 2 * 64
    assert count_params(cfg).total == 151936 * h + 28 * per_layer + h


def test_qknorm_shares_llamas_seeded_weights_and_changes_the_output():
    """The q/k norms draw nothing from the RNG: with the same seed every shared
    parameter equals llama's, so the norms are the only difference."""
    torch.manual_seed(0)
    llama = build_model(small("llama")).eval()
    torch.manual_seed(0)
    qk = build_model(small("llama_qknorm")).eval()
    shared = llama.state_dict()
    for name, value in qk.state_dict().items():
        if name in shared:
            assert torch.equal(value, shared[name]), name
        else:
            assert name.endswith(("attn.q_norm.weight", "attn.k_norm.weight")), name
            assert torch.equal(value, torch.ones_like(value))
    batch, _ = packed_row(97)
    with torch.no_grad():
        assert not torch.allclose(llama(**batch), qk(**batch), atol=1e-4)


def test_qknorm_forward_backward():
    torch.manual_seed(0)
    cfg = small("llama_qknorm", dropout=0.1)
    model = build_model(cfg).train()
    batch, _ = packed_row(cfg.vocab_size)
    logits = model(**batch)
    assert logits.shape == (1, batch["input_ids"].shape[1], cfg.vocab_size)
    loss = torch.nn.functional.cross_entropy(
        logits[0, :-1].float(), batch["input_ids"][0, 1:], reduction="mean"
    )
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    norm_grad = model.layers[0].attn.q_norm.weight.grad
    assert norm_grad.abs().sum() > 0 and model.layers[0].attn.k_norm.weight.grad.abs().sum() > 0
