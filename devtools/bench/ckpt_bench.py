"""`checkpoint_stall_ratio`: how long an async checkpoint blocks the training
loop, over how long a synchronous save of the same state takes (target <= 0.2).

The state is a real trainlab model of about 110 M parameters (llama, hidden
768, 12 layers, vocabulary 32k) with its AdamW state, saved the way the
trainer saves it: DCP through `trainlab.train.loop.checkpointer.begin_save`
into a `CheckpointWriter`'s staging directory, committed with checksums. The
async save blocks for the host copy into the stager kept across saves
(`host_stager`); the write, checksums and commit run in the background and
are waited for outside the timed part. The first async save (which allocates
the stager's buffers, once per run) is not timed. Interleaved samples, medians.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from devtools.bench import BenchResult

SAMPLES = 3


def _state() -> tuple[dict[str, Any], int]:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainlab.config.schema import ModelConfig
    from trainlab.models import build_model

    m = ModelConfig(
        arch="llama", hidden_size=768, num_layers=12, num_heads=12, vocab_size=32000,
        max_seq_len=1024, attention="sdpa",
    )  # fmt: skip
    model = build_model(m)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW's two moments exist, as after any step
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optimizer": optim_sd}, sum(p.numel() for p in model.parameters())


def bench_checkpoint_stall() -> list[BenchResult]:
    from trainlab.train import checkpoint as ck
    from trainlab.train.loop.checkpointer import DCP_DIR, begin_save, host_stager

    warnings.filterwarnings("ignore", message=r"torch\.distributed is .*assuming")
    state, params = _state()
    root = Path(tempfile.mkdtemp(prefix="trainlab-ckpt-bench-"))
    stager = host_stager()
    sync_s, blocked_s, total_s = [], [], []
    try:
        # The trainer's first async save allocates the stager's host buffers; every
        # later one reuses them. One untimed save first, so samples are the steady state.
        warm = ck.CheckpointWriter(root, 0, 1, 1, 0, async_save=True)
        target = str(warm.staging_dir(0) / DCP_DIR)
        warm.submit(0, begin_save(state, target, True, True, None, stager), {"step": 0}, None)
        warm.wait()
        step = 0
        for _ in range(SAMPLES):
            for background in (False, True):
                step += 1
                writer = ck.CheckpointWriter(root, 0, 1, 1, 0, async_save=background)
                t0 = time.perf_counter()
                target = str(writer.staging_dir(step) / DCP_DIR)
                finish = begin_save(state, target, background, True, None, stager)
                writer.submit(step, finish, {"step": step}, None)
                t1 = time.perf_counter()
                writer.wait()
                t2 = time.perf_counter()
                assert writer.completed(), "the checkpoint was not committed"
                (blocked_s if background else sync_s).append(t1 - t0)
                if background:
                    total_s.append(t2 - t0)
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    finally:
        stager.close()
        shutil.rmtree(root, ignore_errors=True)
    blocked, sync = statistics.median(blocked_s), statistics.median(sync_s)
    return [
        BenchResult(
            "checkpoint_stall_ratio",
            blocked,
            "s blocked (lower is better)",
            "synchronous_save_s",
            sync,
            notes={
                "params": params,
                "checkpoint_bytes": size,
                "async_blocked_s": [round(x, 3) for x in blocked_s],
                "async_total_s": [round(x, 3) for x in total_s],
                "sync_s": [round(x, 3) for x in sync_s],
                "target": "<= 0.2",
            },
        )
    ]
