"""AdamW runs torch's fused kernel where the device has one (CPU here): the same
parameters as the per-tensor loop after a few steps, within float rounding."""

from __future__ import annotations

import pytest
import torch

from tests.unit.models.common import small
from trainlab.models import build_model
from trainlab.optim.adamw import AdamWConfig
from trainlab.optim.base import decay_groups


def test_fused_adamw_matches_the_per_tensor_loop():
    torch.manual_seed(0)
    fused_model = build_model(small("llama"))
    loop_model = build_model(small("llama"))
    loop_model.load_state_dict(fused_model.state_dict())
    cfg = AdamWConfig()
    fused = cfg.build(fused_model, lr=1e-2)
    assert fused.defaults["fused"] and all(g["fused"] for g in fused.param_groups)
    loop = torch.optim.AdamW(
        decay_groups(list(loop_model.parameters()), cfg.weight_decay),
        lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False,
    )  # fmt: skip
    ids = torch.randint(0, 97, (2, 16))
    for _ in range(5):
        for model, opt in ((fused_model, fused), (loop_model, loop)):
            model(ids).float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (name, a), b in zip(fused_model.named_parameters(), loop_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_a_group_mixing_tensors_and_dtensors_steps_without_foreach():
    """Expert parallelism under DDP: the routed experts are DTensors and decay with
    the plain dense matrices. Neither torch's fused kernel nor `foreach` (CUDA's
    default) takes such a group, so it runs the per-tensor loop."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Module()
        model.dense = nn.Parameter(torch.randn(4, 4))
        model.experts = nn.Parameter(distribute_tensor(torch.randn(2, 4, 4), mesh, [Shard(0)]))
        opt = AdamWConfig().build(model, lr=1e-2)
        [decayed] = [g for g in opt.param_groups if g["weight_decay"] > 0]
        assert decayed["fused"] is False and decayed["foreach"] is False
        before = model.experts.full_tensor().clone()
        (model.dense.sum() + model.experts.full_tensor().sum()).backward()
        foreach = torch.optim.AdamW([model.dense, model.experts], lr=1e-2, foreach=True)
        with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
            foreach.step()  # what CUDA's default would do with this group
        opt.step()
        assert not torch.equal(model.experts.full_tensor(), before)
    finally:
        dist.destroy_process_group()
