"""Router health, from one optimizer step's statistics (trainlab.models.moe.layer.
finish_step: every MoE layer's per-expert token counts, tokens, dropped
assignments, summed router entropy and aux loss, summed over the data-parallel
ranks).

Per MoE layer i (MLflow groups charts by the prefix, so each layer is one group):

    moe_layer{i}/load_max_over_mean  tokens of the busiest expert / the mean (1 = balanced)
    moe_layer{i}/dead_frac           fraction of experts that got no token
    moe_layer{i}/top_k_share         share of assignments on the top_k busiest experts
                                     (top_k/E when balanced, 1 when collapsed)
    moe_layer{i}/dropped_frac        assignments dropped past the capacity / all
    moe_layer{i}/entropy             mean router entropy per token (nats; ln E at most)
    moe_layer{i}/aux_loss            the balance loss per token (1 when balanced)

and over the layers (what the monitor's rules read): moe/load_max_over_mean,
moe/dead_frac, moe/top_k_share (the worst layer's), moe/aux_loss,
moe/dropped_frac (the mean).
"""

from __future__ import annotations

import torch

WORST = ("load_max_over_mean", "dead_frac", "top_k_share")
MEAN = ("aux_loss", "dropped_frac", "entropy")


def router_metrics(stats: torch.Tensor, num_experts: int, top_k: int) -> dict[str, float]:
    """The metrics of a [layers, E + 4] statistics tensor (one host read)."""
    rows = stats.detach().double().cpu()
    out: dict[str, float] = {}
    per_layer: list[dict[str, float]] = []
    for i, row in enumerate(rows):
        counts = row[:num_experts]
        tokens, dropped, entropy, aux = (float(v) for v in row[num_experts:])
        assigned = float(counts.sum())
        if tokens <= 0:
            continue
        m = {
            "load_max_over_mean": float(counts.max() / counts.mean()) if assigned else 0.0,
            "dead_frac": float((counts == 0).double().mean()),
            "top_k_share": float(counts.topk(top_k).values.sum() / assigned) if assigned else 0.0,
            "dropped_frac": dropped / assigned if assigned else 0.0,
            "entropy": entropy / tokens,
            "aux_loss": aux / tokens,
        }
        per_layer.append(m)
        out.update({f"moe_layer{i}/{k}": v for k, v in m.items()})
    if per_layer:
        out.update({f"moe/{k}": max(m[k] for m in per_layer) for k in WORST})
        out.update({f"moe/{k}": sum(m[k] for m in per_layer) / len(per_layer) for k in MEAN})
    return out
