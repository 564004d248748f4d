"""Synthetic swarm records with a known mixture law (no Ray, no training).

The record has the shape `trainlab.mix.swarm.run_swarm` writes; each trial's
held-out losses come from a law chosen by the test, plus small Gaussian noise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.conftest import RECIPES
from trainlab.config import load_config
from trainlab.mix import record as records
from trainlab.mix.sampling import Budget, sample_mixtures

SOURCES = ("code", "docs", "pkgdocs")
# Enough tokens that the 60-step tiny target (122,880 tokens) caps nothing at 10 epochs...
TOKENS = {"code": 1_000_000, "docs": 400_000, "pkgdocs": 300_000}
PROXY_BUDGET = Budget(seq_len=128, total_rows=320, total_steps=40, max_epochs=10.0)


def per_source_law(w: dict[str, float]) -> dict[str, float]:
    """A source's own held-out loss falls as a power of its share; others help a little."""
    out = {}
    for s in w:
        other = sum(w[o] for o in w if o != s)
        out[f"val_loss/{s}"] = 3.0 + 1.5 * (w[s] + 0.01) ** -0.35 + 0.2 * other
    out["val_loss"] = float(np.mean([out[f"val_loss/{s}"] for s in w]))
    return out


def make_record(tmp_path: Path, law: Callable[[dict[str, float]], dict[str, float]] = per_source_law,
                n: int = 24, noise: float = 0.005, seed: int = 0,
                tokens: dict[str, int] | None = None, swarm_id: str = "0123abcd",
                overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """A completed swarm record under tmp_path/runs, saved to disk and returned."""
    tokens = dict(tokens or TOKENS)
    rng = np.random.default_rng(seed)
    samples = sample_mixtures(tokens, n, PROXY_BUDGET, concentration=3.0, seed=seed)
    config = RECIPES / "tiny.yaml"
    target = load_config(config, overrides).model_dump(mode="json")
    runs_root = str((tmp_path / "runs").resolve())
    target["train"]["runs_root"] = runs_root
    trials = []
    for i, mix in enumerate(samples.mixes):
        metrics = {k: v + float(rng.normal(0, noise)) for k, v in law(mix).items()}
        trials.append({"trial": i, "mix": mix, "status": "completed", "metrics": metrics,
                       "name": f"tiny-swarm-{swarm_id}-{i:03d}", "run_dir": None,
                       "wall_s": 10.0, "kind": samples.kinds[i]})
    rec = {
        "swarm_id": swarm_id, "runs_root": runs_root, "config": str(config.resolve()),
        "overrides": list(overrides), "proxy": [], "experiment": f"tiny-swarm-{swarm_id}",
        "target_config": target, "proxy_config": json.loads(json.dumps(target)),
        "sources": list(tokens), "train_tokens": tokens,
        "sampling": {"concentration": 3.0, "seed": seed, "requested": n, "rejected": 0,
                     "rejected_examples": []},
        "cost": {"proxy_flops": 1e11, "target_flops": 1e12, "swarm_flops": n * 1e11,
                 "flops_fraction": n * 0.1, "runs": n},
        "status": "completed", "trials": trials, "fits": {}, "proposals": [],
        "confirmations": [], "parent_run_id": None, "completed": n, "failed": 0,
    }
    records.save(rec)
    return rec
