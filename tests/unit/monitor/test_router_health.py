"""Router health (trainlab.models.moe.metrics) and its rules (trainlab.monitor.
rules: expert_imbalance, router_collapse): a router whose logits are pinned on a
few experts makes the layer's statistics, the metrics say so, and the rules fire
as configured; a balanced router fires nothing."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.models.common import small
from trainlab.config.schema import AlertsConfig
from trainlab.models import build_model
from trainlab.models.moe.layer import finish_step, moe_layers
from trainlab.models.moe.metrics import router_metrics
from trainlab.monitor.rules import build_rules

E, K = 4, 2


class Pinned(torch.nn.Module):
    """Router logits fixed per token (the rows of `logits`, cycled over the tokens)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.logits.repeat(x.shape[0] // self.logits.shape[0] + 1, 1)[: x.shape[0]]
        return rows + 0 * x[:, :1]


def step_metrics(logits: torch.Tensor) -> dict[str, float]:
    model = build_model(small("llama", moe={"num_experts": E, "top_k": K})).train()
    layers = moe_layers(model)
    for layer in layers:
        layer.router.gate = Pinned(logits)
    model(torch.randint(0, 97, (2, 8)))
    stats = finish_step(layers, lambda t: t, 0.0, torch.device("cpu"))
    return router_metrics(stats, E, K)


# Each token's two experts cycle over all four: perfectly balanced.
BALANCED = torch.tensor([[5.0, 4.0, 0, 0], [0, 0, 5.0, 4.0]])
# Every token on experts 0 and 1: collapsed, experts 2 and 3 dead.
COLLAPSED = torch.tensor([[5.0, 4.0, 0, 0]])


def test_metrics_of_a_balanced_and_a_collapsed_router():
    good, bad = step_metrics(BALANCED), step_metrics(COLLAPSED)
    assert good["moe/load_max_over_mean"] == pytest.approx(1.0)
    assert good["moe/dead_frac"] == 0 and good["moe/top_k_share"] == pytest.approx(K / E)
    assert bad["moe/load_max_over_mean"] == pytest.approx(2.0)
    assert bad["moe/dead_frac"] == pytest.approx(0.5) and bad["moe/top_k_share"] == 1.0
    assert set(bad) >= {f"moe_layer{i}/{k}" for i in (0, 1) for k in ("entropy", "aux_loss")}
    # the aux loss is E * sum f_e P_e: 1 per token when balanced, more when collapsed
    assert good["moe/aux_loss"] < bad["moe/aux_loss"]
    assert 0 < bad["moe/entropy"] < math.log(E)


def fired(metrics_per_step: list[dict[str, float]], alerts: AlertsConfig) -> list[tuple]:
    rules = [r for r in build_rules(alerts) if r.name in ("expert_imbalance", "router_collapse")]
    out = []
    for step, metrics in enumerate(metrics_per_step, 1):
        for rule in rules:
            alert = rule.observe(step, metrics, 0.0)
            if alert is not None:
                out.append((alert.rule, alert.severity, step))
    return out


def test_a_sustained_collapse_raises_p1_imbalance_and_the_configured_p0():
    alerts = AlertsConfig.model_validate(
        {"expert_imbalance": {"window": 3}, "router_collapse": {"window": 2, "severity": "P0"}}
    )
    good, bad = step_metrics(BALANCED), step_metrics(COLLAPSED)
    assert fired([good] * 6, alerts) == []
    got = fired([good, bad, bad, bad, bad], alerts)
    assert got == [("router_collapse", "P0", 3), ("expert_imbalance", "P1", 4)]
    # one step of collapse is not sustained
    assert fired([good, bad, good, good], alerts) == []


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tests.train_helpers import dataset_dir

    return dataset_dir(tmp_path_factory)


@pytest.mark.parametrize("on_p0", ["checkpoint_and_stop", "rollback_and_skip"])
def test_a_collapsed_router_configured_p0_is_acted_on(dataset, tmp_path, on_p0):
    """router_collapse as P0 with tracking.alerts.on_p0 acting (issue 39): judged from
    the router metrics of each logged step on every rank, acted on one step later as
    every P0 signal is: the run stops (exit 4's status) at the logged step, or rolls
    back to the checkpoint before it and skips the steps since (here the batches
    that collapsed it)."""
    from tests.train_helpers import local_loader, make_job, tiny_config
    from trainlab.runstatus import RunStatus
    from trainlab.train.loop.trainer import Trainer
    from trainlab.train.parallel.distributed import DistEnv

    cfg = tiny_config(
        dataset,
        model={"moe": {"num_experts": E, "top_k": K, "expert_ffn_hidden_size": 32}},
        train={"total_steps": 8, "log_interval": 2, "eval_interval": 4,
               "checkpoint": {"every_steps": 2, "keep_last": 4}},
        tracking={"alerts": {"on_p0": on_p0, "max_rollbacks": 1,
                             "router_collapse": {"severity": "P0", "window": 1}}},
    )  # fmt: skip
    job = make_job(cfg, tmp_path / "run")
    trainer = Trainer(job, local_loader(job), DistEnv())
    collapsed = Pinned(COLLAPSED)

    def collapse_in_steps_3_4(gate):  # the gate's own weights stay (the checkpoints)
        real = gate.forward  # (during step s the loop's counter is s - 1)
        return lambda x: collapsed(x) if 2 <= trainer.step < 4 else real(x)

    for layer in moe_layers(trainer.model):
        layer.router.gate.forward = collapse_in_steps_3_4(layer.router.gate)
    summary = trainer.fit()
    if on_p0 == "checkpoint_and_stop":
        assert summary["status"] == RunStatus.STOPPED_BY_ALERT
        assert summary["final_step"] == 4 and summary["resume_step"] == 4
        assert summary["stop_reason"].startswith("P0 alert router_collapse at step 4: ")
        assert "moe/top_k_share 1" in summary["stop_reason"]
    else:  # rolled back to step 2, the batches of steps 3-4 skipped, healthy again
        [rollback] = summary["rollbacks"]
        assert rollback == {"from_step": 4, "to_step": 2, "skipped": [3, 4],
                            "rule": "router_collapse"}  # fmt: skip
        assert summary["status"] == RunStatus.COMPLETED and summary["final_step"] == 8
