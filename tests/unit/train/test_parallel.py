"""Parallel wrapping applied from outside the model, on 2 CPU processes (gloo)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.train_helpers import tiny_config
from trainlab.train.loop.state import ModelState
from trainlab.train.loop.step import train_step
from trainlab.train.parallel.distributed import DistEnv

PARALLEL = {"strategy": "fsdp", "zero_stage": 3, "dp": 2}


def _batch(rank: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rank)
    ids = rng.integers(0, 1024, size=(4, 32), dtype=np.int64)
    return {"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    env = DistEnv(rank, world, 0, torch.device("cpu"))
    result = {}
    for precision in ("fp32", "bf16"):
        cfg = tiny_config(
            Path("unused"),
            train={"precision": precision},
            parallel=PARALLEL,
            resource={"num_workers": 2},
        )
        state = ModelState(cfg, env)
        block = state.model.layers[0]
        gathered = []
        handle = block.register_forward_pre_hook(
            lambda m, args, seen=gathered: seen.append(str(m.attn_norm.weight.dtype))
        )
        loss, norm = train_step(state, cfg, 0, [_batch(rank)], env.device)
        handle.remove()
        sharded = {str(p.to_local().dtype) for p in state.model.parameters()}
        moments = {str(s["exp_avg"].to_local().dtype) for s in state.optimizers.only().state.values()}
        result[precision] = {
            "loss": loss,
            "grad_norm": norm,
            "sharded_dtypes": sorted(sharded),
            "moment_dtypes": sorted(moments),
            "compute_dtype": gathered[0],
        }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_bf16_keeps_fp32_shards_and_computes_in_bf16(tmp_path):
    """FSDP2 with a MixedPrecisionPolicy: master weights and Adam moments stay fp32
    and sharded, the all-gathered parameters a block computes with are bf16, and
    the first step's loss matches fp32 closely."""
    out = tmp_path / "result.json"
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    r = json.loads(out.read_text())
    for precision in ("fp32", "bf16"):
        assert r[precision]["sharded_dtypes"] == ["torch.float32"]
        assert r[precision]["moment_dtypes"] == ["torch.float32"]
    assert r["fp32"]["compute_dtype"] == "torch.float32"
    assert r["bf16"]["compute_dtype"] == "torch.bfloat16"
    assert r["bf16"]["loss"] == pytest.approx(r["fp32"]["loss"], abs=0.02)
    assert r["bf16"]["grad_norm"] == pytest.approx(r["fp32"]["grad_norm"], rel=0.05)
