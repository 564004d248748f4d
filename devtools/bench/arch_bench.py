"""Architecture benchmarks, each against a baseline measured in the same run.

- `hf_vs_builtin`: tokens/s of one training step (forward on a packed row with its
  document mask, chunked cross-entropy as the trainer takes it, backward, AdamW
  step; fp32 on CPU, one torch thread) of `model.arch: hf:llama` (transformers'
  LlamaForCausalLM under trainlab's forward contract, trainlab.models.hf) against
  trainlab's own `llama` of the same shape and parameter count. What the ratio
  shows is the cost of training a transformers family through `hf:` instead of a
  built-in one. The two alternate, which one goes first alternating too, after a
  warm-up of each; each side's figure is the median over rounds.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from devtools.bench import BenchResult

MODEL = {
    "hidden_size": 256,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "ffn_hidden_size": 512,
    "vocab_size": 8192,
    "max_seq_len": 256,
    "tie_embeddings": True,
}
SEQ_LEN, MICRO_BATCH = 256, 4
# Documents packed in each row (lengths sum to SEQ_LEN): both models pay for the mask.
DOCUMENTS = [[96, 64, 96], [128, 128], [32, 160, 64], [256]]
WARMUP_STEPS, STEPS, ROUNDS = 2, 6, 5
THREADS = 1  # one core of a shared 2-core machine: steadier than two


def _batch(seed: int = 0) -> dict[str, Any]:
    """One micro batch in the loader's format: packed rows, positions restarting per
    document, labels the next token of the same document (-100 at each document's end)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, MODEL["vocab_size"], (MICRO_BATCH, SEQ_LEN), generator=g)
    positions = torch.zeros(MICRO_BATCH, SEQ_LEN, dtype=torch.long)
    documents = torch.zeros(MICRO_BATCH, SEQ_LEN, dtype=torch.int32)
    labels = torch.full((MICRO_BATCH, SEQ_LEN), -100, dtype=torch.long)
    for row, lengths in enumerate(DOCUMENTS):
        assert sum(lengths) == SEQ_LEN
        at = 0
        for doc, n in enumerate(lengths):
            positions[row, at : at + n] = torch.arange(n)
            documents[row, at : at + n] = doc
            labels[row, at : at + n - 1] = ids[row, at + 1 : at + n]
            at += n
    return {"input_ids": ids, "position_ids": positions, "document_ids": documents,
            "labels": labels}  # fmt: skip


def _setup(arch: str) -> dict[str, Any]:
    import torch

    from trainlab.config import ExperimentConfig
    from trainlab.models import build_model

    cfg = ExperimentConfig.model_validate({"name": "bench-arch", "model": {**MODEL, "arch": arch}})
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return {"arch": arch, "model": model, "opt": opt, "params": params}


def _steps(side: dict[str, Any], batch: dict[str, Any], steps: int) -> float:
    """Seconds for `steps` training steps of `side` on `batch`."""
    import torch

    from trainlab.train.loop.step import loss_sum_and_count

    model, opt = side["model"], side["opt"]
    started = time.perf_counter()
    for _ in range(steps):
        loss_sum, count = loss_sum_and_count(model, batch)
        (loss_sum / count).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def bench_hf_vs_builtin() -> list[BenchResult]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        batch = _batch()
        hf, ours = _setup("hf:llama"), _setup("llama")
        assert hf["params"] == ours["params"], (hf["params"], ours["params"])
        for side in (hf, ours):
            _steps(side, batch, WARMUP_STEPS)
        seconds: dict[str, list[float]] = {"hf:llama": [], "llama": []}
        for i in range(ROUNDS):  # hf/ours, ours/hf, ...
            for side in (hf, ours) if i % 2 == 0 else (ours, hf):
                seconds[side["arch"]].append(_steps(side, batch, STEPS))
    finally:
        torch.set_num_threads(threads)
    tokens = MICRO_BATCH * SEQ_LEN * STEPS

    def rates(arch: str) -> list[float]:
        return [tokens / s for s in seconds[arch]]

    value, baseline = statistics.median(rates("hf:llama")), statistics.median(rates("llama"))
    return [
        BenchResult(
            "hf_llama_train_step_throughput",
            value,
            "tokens/s",
            "builtin_llama_train_step_throughput",
            baseline,
            notes={
                "statistic": f"median over {ROUNDS} interleaved rounds of {STEPS} steps "
                f"each (order alternating), after {WARMUP_STEPS} warm-up steps each",
                "hf_round_tokens_per_s": [round(r) for r in rates("hf:llama")],
                "builtin_round_tokens_per_s": [round(r) for r in rates("llama")],
                "params": {"hf:llama": hf["params"], "llama": ours["params"]},
                "shape": {**MODEL, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH},
                "documents_per_row": [len(d) for d in DOCUMENTS],
                "step": "forward (document mask, SDPA) + chunked cross-entropy + backward "
                "+ grad clip + AdamW, fp32",
                "torch_threads": THREADS,
            },
        )
    ]
