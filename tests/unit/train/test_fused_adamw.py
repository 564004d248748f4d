"""AdamW runs torch's fused kernel where the device has one (CPU here): the same
parameters as the per-tensor loop after a few steps, within float rounding."""

from __future__ import annotations

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
