"""Proposing a mixture: the fitted law minimised under bounds and repetition caps.

The caps are those of the *target* run (its token budget, its
data.max_epochs_per_source), not the proxy's: a mix that is fine for a short
proxy can need too many epochs of a small source at full length. The search
is SciPy's SLSQP (sum of weights = 1, per-source bounds) started from the
best of many feasible Dirichlet candidates and the swarm's best trials, so a
piecewise-constant law (gbm) still gets a sensible optimum. The uncertainty
is a bootstrap of the swarm: the law refitted on resampled trials, predicting
at the proposal (5th-95th percentile).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from trainlab.errors import UserError
from trainlab.mix.fit import Law, dataset, fit_law
from trainlab.mix.sampling import MIN_WEIGHT, Budget, feasibility, share_caps
from trainlab.mix.targets import Target

CANDIDATES = 2000
BOOTSTRAP = 100
ROUND = 4


def bounds(sources: list[str], train_tokens: dict[str, int], target_budget: Budget,
           low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-source [lo, hi]: the command's bounds, hi lowered to the target run's cap."""
    caps = share_caps({s: train_tokens[s] for s in sources}, target_budget)
    lo = np.full(len(sources), low)
    hi = np.array([min(high, caps[s]) for s in sources])
    if np.any(hi < lo) or lo.sum() > 1 + 1e-9 or hi.sum() < 1 - 1e-9:
        detail = ", ".join(f"{s} <= {h:.3g}" for s, h in zip(sources, hi, strict=True))
        raise UserError(f"--min {low:g} / --max {high:g}: no mixture fits these bounds and "
                        f"the target run's repetition caps ({detail})")
    return lo, hi


def _project(w: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The points of {lo <= w <= hi, sum w = 1} nearest each row of `w` (bisection on a
    per-row shift: clip(w + shift) sums to 1)."""
    w2 = np.atleast_2d(w)
    a, b = np.full(len(w2), -2.0), np.full(len(w2), 2.0)
    for _ in range(60):
        mid = (a + b) / 2
        over = np.clip(w2 + mid[:, None], lo, hi).sum(axis=1) > 1
        b, a = np.where(over, mid, b), np.where(over, a, mid)
    out = np.clip(w2 + ((a + b) / 2)[:, None], lo, hi)
    return out if w.ndim == 2 else out[0]


def optimise(law: Law, lo: np.ndarray, hi: np.ndarray, starts: list[np.ndarray],
             seed: int = 0) -> np.ndarray:
    """argmin of the law over the bounded simplex."""
    from scipy.optimize import minimize

    rng = np.random.default_rng(seed)
    k = len(lo)
    cands = _project(rng.dirichlet(np.ones(k), CANDIDATES), lo, hi)
    preds = law.predict(cands)
    starts = [_project(s, lo, hi) for s in starts[:1]] + list(cands[np.argsort(preds)[:2]])
    best, best_val = None, np.inf
    for x0 in starts:
        res = minimize(lambda w: float(law.predict(w)[0]), x0, method="SLSQP",
                       bounds=list(zip(lo, hi, strict=True)),
                       constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1.0}],
                       options={"maxiter": 200, "ftol": 1e-10})
        w = _project(res.x, lo, hi)
        v = float(law.predict(w)[0])
        if v < best_val:
            best, best_val = w, v
    return best


def rounded(w: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Weights of ROUND digits summing to 1 within bounds (the remainder goes to the
    source with the most room)."""
    r = np.clip(np.round(w, ROUND), lo, hi)
    room = np.where(r.sum() < 1, hi - r, r - lo)
    j = int(np.argmax(room))
    r[j] = round(r[j] + 1.0 - r.sum(), ROUND)
    return r


def bootstrap_interval(name: str, sources: list[str], X: np.ndarray, y: np.ndarray,
                       at: np.ndarray, n: int = BOOTSTRAP, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    preds = []
    for _ in range(n):
        i = rng.integers(0, len(y), len(y))
        if len(np.unique(i)) < 3:
            continue
        preds.append(fit_law(name, sources, X[i], y[i]).predict(at)[0])
    return [float(np.percentile(preds, 5)), float(np.percentile(preds, 95))]


def propose(record: dict[str, Any], target: Target, target_budget: Budget, model: str, *,
            low: float = MIN_WEIGHT, high: float = 1.0) -> dict[str, Any]:
    """The proposal: mix, predicted value and interval at it, and how it was chosen."""
    sources = record["sources"]
    X, y, _ = dataset(record, target)
    law = fit_law(model, sources, X, y)
    lo, hi = bounds(sources, record["train_tokens"], target_budget, low, high)
    w = rounded(optimise(law, lo, hi, [X[np.argmin(y)]]), lo, hi)
    mix = dict(zip(sources, map(float, w), strict=True))
    why = feasibility(mix, record["train_tokens"], target_budget)
    if why is not None:  # rounding pushed a source a row over its cap
        raise UserError(f"proposal {mix} misses the target run's cap: {why}; lower --max")
    best_trial = int(np.argmin(y))
    return {
        "swarm_id": record["swarm_id"], "target": target.text, "model": model, "mix": mix,
        "predicted": float(law.predict(w)[0]),
        "predicted_interval": bootstrap_interval(model, sources, X, y, w),
        "bounds": {s: [float(a), float(b)] for s, a, b in zip(sources, lo, hi, strict=True)},
        "best_trial": {"mix": dict(zip(sources, map(float, X[best_trial]), strict=True)),
                       "observed": float(y[best_trial]),
                       "predicted": float(law.predict(X[best_trial])[0])},
    }


def write_recipe(out: Path, record: dict[str, Any], proposal: dict[str, Any]) -> Path:
    """The recipe override: `extends` the swarm's target config, sets data.mix (and the
    --set overrides the swarm was run with), and a sidecar `<out>.proposal.json`."""
    import os

    import yaml

    from trainlab.config import load_config
    from trainlab.config.loader import apply_overrides

    out = out.resolve()
    base = Path(record["config"])
    raw: dict[str, Any] = apply_overrides({}, record.get("overrides") or [])
    raw.pop("name", None)
    body = {
        "extends": os.path.relpath(base, out.parent),
        "name": out.stem.replace(".", "-"),
        "purpose": (f"Mixture proposed by `trainlab mix propose {record['swarm_id']} --target "
                    f"{proposal['target']}` ({proposal['model']} law): predicted "
                    f"{proposal['predicted']:.4f} at proxy scale."),
        **raw,
    }
    body.setdefault("data", {})["mix"] = proposal["mix"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# trainlab mix propose {record['swarm_id']} --target {proposal['target']}\n"
                   + yaml.safe_dump(body, sort_keys=False))
    resolved = load_config(out).data.mix
    if {k: round(v, ROUND) for k, v in resolved.items()} != proposal["mix"]:
        raise UserError(f"{out}: its resolved data.mix {resolved} is not the proposal "
                        f"{proposal['mix']} (the base config mixes other sources)")
    sidecar = out.with_suffix(".proposal.json")
    sidecar.write_text(json.dumps({**proposal, "recipe": str(out),
                                   "runs_root": record["runs_root"]}, indent=1) + "\n")
    return sidecar
