"""What a swarm costs next to the run it chooses a mixture for.

FLOPs come from the planner (`trainlab.plan`: training FLOPs per token x tokens
per step x steps), so the fraction is the one RegMix and Olmix report (extra
compute over the target run). Wall time: before the swarm, the target's wall
time is unknown, so the fraction is estimated from the FLOPs at equal
throughput divided by the trials run at once; afterwards it is the swarm's
measured wall time over the target's estimated from the proxies' measured
FLOP/s, or its measured one once `mix confirm` has trained it.
"""

from __future__ import annotations

from typing import Any

from trainlab.config import ExperimentConfig


def run_flops(cfg: ExperimentConfig) -> float:
    """Training FLOPs of one run of `cfg` (planner's FLOPs/token x tokens)."""
    from trainlab.plan import plan

    p = plan(cfg)
    return float(p.flops_per_token) * p.tokens_per_step * cfg.train.total_steps


def estimate(proxy: ExperimentConfig, target: ExperimentConfig, runs: int,
             concurrency: int) -> dict[str, Any]:
    """The cost printed (and stored) before the swarm starts."""
    per_proxy, target_flops = run_flops(proxy), run_flops(target)
    swarm = per_proxy * runs
    return {
        "proxy_flops": per_proxy,
        "target_flops": target_flops,
        "swarm_flops": swarm,
        "runs": runs,
        "flops_fraction": swarm / target_flops,
        "wall_fraction_estimate": swarm / target_flops / max(1, concurrency),
    }


def measured(cost: dict[str, Any], trials: list[dict[str, Any]], swarm_wall_s: float,
             target_wall_s: float | None = None) -> dict[str, Any]:
    """`cost` with the measured swarm: FLOPs of the runs that trained, wall time, fractions."""
    ran = [t for t in trials if t.get("wall_s") and not t.get("reused_from")]
    flops = cost["proxy_flops"] * len(ran)
    busy = sum(t["wall_s"] for t in ran)
    out = dict(cost)
    out["swarm_flops"] = flops
    out["flops_fraction"] = flops / cost["target_flops"]
    out["swarm_wall_s"] = round(swarm_wall_s, 1)
    if target_wall_s is None and busy > 0:
        # A proxy's FLOP/s (wall time includes Ray Train's start-up) carried to the target.
        target_wall_s = cost["target_flops"] / (cost["proxy_flops"] * len(ran) / busy)
        out["target_wall_s_source"] = "estimated from the proxies' FLOP/s"
    elif target_wall_s is not None:
        out["target_wall_s_source"] = "measured (mix confirm)"
    if target_wall_s:
        out["target_wall_s"] = round(target_wall_s, 1)
        out["wall_fraction"] = swarm_wall_s / target_wall_s
    return out
