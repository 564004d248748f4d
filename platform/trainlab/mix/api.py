"""The fit and propose steps as the CLI runs them: load the swarm record, compute,
store the result in the record, and add it (numbers and plots) to the parent run."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from trainlab.config import ExperimentConfig
from trainlab.mix import record as records
from trainlab.mix.fit import MODELS, dataset, fit_law, fit_swarm
from trainlab.mix.sampling import MIN_WEIGHT
from trainlab.mix.targets import parse_target


def _slug(target: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", target).strip("_")


def _models(model: str | None) -> tuple[str, ...]:
    if model is None:
        return MODELS
    from trainlab.mix.fit import make_model

    make_model(model)  # UserError for an unknown name
    return (model,)


def run_fit(swarm_id: str, target_text: str, model: str | None = None,
            runs_root: str = "runs", log: bool = True) -> dict[str, Any]:
    from trainlab.mix import plots

    record = records.load(swarm_id, runs_root)
    target = parse_target(target_text, record["sources"])
    fit = fit_swarm(record, target, _models(model))
    record["fits"][target.text] = fit
    records.save(record)
    if log and record.get("parent_run_id"):
        from trainlab.mix.swarm import log_to_parent

        slug = _slug(target.text)
        png = plots.save(plots.predicted_vs_observed(fit),
                         records.swarm_dir(record["runs_root"], swarm_id) / "plots" / f"fit-{slug}.png")
        metrics = {f"fit.{slug}.{n}.{k}": v for n, m in fit["models"].items() for k, v in m.items()}
        log_to_parent(record, metrics, {f"fit.{slug}.best_model": fit["best_model"]}, [png])
    return fit


def run_propose(swarm_id: str, target_text: str, *, low: float = MIN_WEIGHT, high: float = 1.0,
                model: str | None = None, out: str | None = None, runs_root: str = "runs",
                log: bool = True) -> dict[str, Any]:
    from trainlab.mix import plots
    from trainlab.mix.propose import propose, write_recipe
    from trainlab.mix.swarm import budget

    record = records.load(swarm_id, runs_root)
    target = parse_target(target_text, record["sources"])
    if model is None:
        model = fit_swarm(record, target)["best_model"]
    else:
        _models(model)
    target_cfg = ExperimentConfig.model_validate(record["target_config"])
    prop = propose(record, target, budget(target_cfg), model, low=low, high=high)
    sdir = records.swarm_dir(record["runs_root"], swarm_id)
    recipe = Path(out) if out else sdir / f"proposal-{_slug(target.text)}.yaml"
    write_recipe(recipe, record, prop)
    prop["recipe"] = str(recipe.resolve())
    prop["swarm_cost_fraction"] = float(record["cost"]["flops_fraction"])
    record["proposals"].append(prop)
    records.save(record)
    if log and record.get("parent_run_id"):
        from trainlab.mix.swarm import log_to_parent

        X, y, _ = dataset(record, target)
        law = fit_law(model, record["sources"], X, y)
        png = plots.save(plots.response(law, X.mean(axis=0), X, y, target.text, prop["mix"]),
                         sdir / "plots" / f"response-{_slug(target.text)}.png")
        slug = _slug(target.text)
        log_to_parent(record, {f"propose.{slug}.predicted": prop["predicted"],
                               **{f"propose.{slug}.mix.{s}": w for s, w in prop["mix"].items()}},
                      {f"propose.{slug}.model": model}, [png, recipe])
    return prop
