"""The shared building blocks: packed-row attention, positions, RoPE, QK-norm hook."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.models.common import packed_row, small
from trainlab.models import build_model, segment_positions
from trainlab.models.attention import AttentionMask
from trainlab.models.layers import Attention, RMSNorm, apply_rope
from trainlab.models.registry import arch_names


def test_segment_positions_restart_at_each_document():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1]])
    assert segment_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


@pytest.mark.parametrize("arch", arch_names())
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


@pytest.mark.parametrize("arch", ["llama", "llama_qknorm"])
def test_rope_depends_only_on_relative_positions(arch):
    torch.manual_seed(0)
    model = build_model(small(arch)).eval()
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


def test_attention_without_qk_norm_has_no_norm_modules():
    attn = Attention(small("llama"), bias=False)
    assert attn.q_norm is None and attn.k_norm is None
    assert sorted(n for n, _ in attn.named_parameters()) == ["k.weight", "out.weight", "q.weight", "v.weight"]


def test_qk_norm_hook_normalizes_each_head_before_rope():
    """The hook's norms see [B, H, T, head_dim] queries and keys, before RoPE:
    checked against the computation written out."""
    torch.manual_seed(0)
    cfg = small("llama", attention="eager")
    eps = cfg.norm_eps
    attn = Attention(cfg, bias=False, qk_norm=lambda d: RMSNorm(d, eps)).eval()
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    b, t, h, kv, d = 2, 7, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = torch.randn(b, t, cfg.hidden_size)
    pos = torch.arange(t).expand(b, t)
    angles = pos[..., None].float() / cfg.rope_theta ** (torch.arange(0, d, 2) / d)
    angles = torch.cat((angles, angles), dim=-1)[:, None]
    rope = (angles.cos(), angles.sin())

    def rms(z, w):
        return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * w

    q, k, v = attn.q(x), attn.k(x), attn.v(x)
    q = rms(q.view(b, t, h, d).transpose(1, 2), attn.q_norm.weight)
    k = rms(k.view(b, t, kv, d).transpose(1, 2), attn.k_norm.weight)
    v = v.view(b, t, kv, d).transpose(1, 2)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    expected = attn.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1))
    with torch.no_grad():
        torch.testing.assert_close(attn(x, AttentionMask(t), rope), expected)


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
