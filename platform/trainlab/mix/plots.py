"""Figures of a swarm's law: predicted vs observed per trial, the fitted response
along each source's weight, and the proposal. PNGs for MLflow, figures for notebooks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trainlab.mix.fit import Law, toward


def predicted_vs_observed(fit: dict[str, Any], ax: Any = None) -> Any:
    """Out-of-fold predictions of the best model against the observed target."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(4.5, 4.5))[1]
    obs, pred = np.array(fit["observed"]), np.array(fit["oof_predicted"])
    ax.scatter(obs, pred, s=18)
    lo, hi = min(obs.min(), pred.min()), max(obs.max(), pred.max())
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    m = fit["models"][fit["best_model"]]
    ax.set(xlabel=f"observed {fit['target']}", ylabel="predicted (out of fold)",
           title=f"{fit['best_model']}: Spearman {m['spearman_cv']:.2f}, RMSE {m['rmse_cv']:.3g}")
    return ax.figure


def response(law: Law, at: np.ndarray, X: np.ndarray, y: np.ndarray, target: str,
             proposal: dict[str, float] | None = None) -> Any:
    """The law along each source's weight (others in proportion to `at`), trials and proposal."""
    import matplotlib.pyplot as plt

    k = len(law.sources)
    fig, axes = plt.subplots(1, k, figsize=(3.6 * k, 3.2), sharey=True)
    for j, (s, ax) in enumerate(zip(law.sources, np.atleast_1d(axes), strict=True)):
        ws = np.linspace(0.01, 0.95, 60)
        rows = np.array([toward(at, j, (w - at[j]) / (1 - at[j])) for w in ws])
        ax.plot(ws, law.predict(rows), label="law")
        ax.scatter(X[:, j], y, s=10, alpha=0.6, label="trials")
        if proposal:
            ax.axvline(proposal[s], color="C3", ls="--", label="proposal")
        ax.set(xlabel=f"weight of {s}")
    np.atleast_1d(axes)[0].set(ylabel=target)
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
