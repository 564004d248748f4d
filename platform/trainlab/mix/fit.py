"""Fitting a mixture law: the target as a function of the mixture weights.

Models (all kept libraries, no hand-written solvers):
- `loglinear`: log y = c + sum_j t_j w_j (Data Mixing Laws' form; Olmix's default),
  scikit-learn least squares on log y.
- `logweights`: log y = c + sum_j t_j log(w_j + eps), a per-source power law
  (a source's own loss falls roughly linearly in the log of its share).
- `quadratic`: ridge regression on degree-2 polynomial features of the weights.
- `gbm`: LightGBM gradient-boosted trees (RegMix's regressor).

Fit quality is cross-validated (k-fold, out-of-fold predictions pooled): the
Spearman rank correlation between predicted and observed (what matters for
choosing a mixture) and the RMSE. Sensitivities are the best model's slope of
the target when the mix moves toward one source (other weights shrinking in
proportion), at the swarm's mean mixture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainlab.errors import UserError
from trainlab.mix.targets import Target

MODELS = ("loglinear", "logweights", "quadratic", "gbm")
LOG_EPS = 0.01  # log(w + eps): a weight of 0 (a reused run without a new source) stays finite
MIN_RUNS = 4


def make_model(name: str) -> Any:
    """A scikit-learn style regressor on (weights -> log target)."""
    from sklearn.linear_model import LinearRegression, Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import FunctionTransformer, PolynomialFeatures

    if name == "loglinear":
        return LinearRegression()
    if name == "logweights":
        return make_pipeline(FunctionTransformer(lambda w: np.log(w + LOG_EPS)), LinearRegression())
    if name == "quadratic":
        return make_pipeline(PolynomialFeatures(2, include_bias=False), Ridge(alpha=1e-3))
    if name == "gbm":
        from lightgbm import LGBMRegressor

        return LGBMRegressor(n_estimators=200, learning_rate=0.05, num_leaves=4,
                             min_child_samples=2, min_data_in_bin=1, n_jobs=1, verbose=-1)
    raise UserError(f"--model {name!r}: one of {', '.join(MODELS)}")


@dataclass
class Law:
    """A fitted model: predicts the target (not its log) for rows of weights."""

    name: str
    sources: list[str]
    model: Any

    def predict(self, weights: np.ndarray) -> np.ndarray:
        return np.exp(self.model.predict(np.atleast_2d(weights)))


def fit_law(name: str, sources: list[str], X: np.ndarray, y: np.ndarray) -> Law:
    return Law(name, sources, make_model(name).fit(X, np.log(y)))


def dataset(record: dict[str, Any], target: Target) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(weights [n, sources], target values [n], row -> index in record["trials"]) of the
    trials that completed and recorded every term of the target."""
    rows, ys, idx = [], [], []
    for i, t in enumerate(record["trials"]):
        if t.get("status") != "completed":
            continue
        v = target.value(t.get("metrics") or {})
        if v is None or v <= 0:
            continue
        rows.append([float(t["mix"].get(s, 0.0)) for s in record["sources"]])
        ys.append(v)
        idx.append(i)
    return np.array(rows, dtype=float).reshape(-1, len(record["sources"])), np.array(ys), idx


def cross_validate(name: str, sources: list[str], X: np.ndarray, y: np.ndarray,
                   folds: int = 5, seed: int = 0) -> dict[str, Any]:
    """Out-of-fold predictions of model `name`; Spearman and RMSE over all of them."""
    from scipy.stats import spearmanr
    from sklearn.model_selection import KFold

    k = min(folds, len(y))
    pred = np.empty_like(y)
    for train, test in KFold(k, shuffle=True, random_state=seed).split(X):
        pred[test] = fit_law(name, sources, X[train], y[train]).predict(X[test])
    rho = spearmanr(pred, y).statistic if np.ptp(pred) > 0 and np.ptp(y) > 0 else float("nan")
    return {"spearman_cv": float(rho), "rmse_cv": float(np.sqrt(np.mean((pred - y) ** 2))),
            "oof_predicted": pred.tolist()}


def toward(mix: np.ndarray, j: int, h: float) -> np.ndarray:
    """`mix` moved by h toward source j (the other weights shrink in proportion)."""
    e = np.zeros_like(mix)
    e[j] = 1.0
    return mix + h * (e - mix)


def sensitivities(law: Law, at: np.ndarray, h: float = 0.02) -> dict[str, float]:
    """d target / d h along `toward(at, j, h)` for each source j (central difference)."""
    out = {}
    for j, s in enumerate(law.sources):
        hi, lo = law.predict(toward(at, j, h))[0], law.predict(toward(at, j, -h))[0]
        out[s] = float((hi - lo) / (2 * h))
    return out


def _rank_key(m: dict[str, Any]) -> tuple[float, float]:
    rho = m["spearman_cv"]
    return (-(rho if math.isfinite(rho) else -2.0), m["rmse_cv"])


def fit_swarm(record: dict[str, Any], target: Target, models: tuple[str, ...] = MODELS,
              folds: int = 5) -> dict[str, Any]:
    """Cross-validate every model in `models` on the swarm; the best by Spearman, then RMSE."""
    X, y, idx = dataset(record, target)
    if len(y) < MIN_RUNS:
        raise UserError(f"swarm {record['swarm_id']}: {len(y)} completed runs record "
                        f"{target.text}; a fit needs at least {MIN_RUNS}")
    sources = record["sources"]
    results = {name: cross_validate(name, sources, X, y, folds) for name in models}
    best = min(results, key=lambda n: _rank_key(results[n]))
    law = fit_law(best, sources, X, y)
    centre = X.mean(axis=0)
    return {
        "swarm_id": record["swarm_id"], "target": target.text, "n_runs": int(len(y)),
        "models": {n: {"spearman_cv": r["spearman_cv"], "rmse_cv": r["rmse_cv"]}
                   for n, r in results.items()},
        "best_model": best,
        "sensitivities": sensitivities(law, centre),
        "sensitivities_at": dict(zip(sources, map(float, centre), strict=True)),
        "observed": y.tolist(), "oof_predicted": results[best]["oof_predicted"],
        "trials": idx, "target_range": [float(y.min()), float(y.max())],
    }
