"""Small configs and packed rows shared by the model tests."""

from __future__ import annotations

import torch

from trainlab.config.schema import ModelConfig


def small(arch: str, **kw) -> ModelConfig:
    base = {
        "arch": arch,
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "vocab_size": 97,
        "max_seq_len": 64,
    }
    if arch != "gpt2":  # gpt2 has no grouped-query attention
        base["num_kv_heads"] = 2
    return ModelConfig.model_validate({**base, **kw})


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
