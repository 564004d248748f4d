"""Ray Tune searches over data-mix weights: one trial = one ordinary trainlab run.

Changing the mix costs a number in the config, not a new dataset (the stream is
mixed at read time), so a mix search is a list of configs that differ only in
`data.mix.*`. Each trial is a Tune function trainable that calls
`trainlab.train.run` (one TorchTrainer per trial, as Ray Train V2 wants), so a
trial leaves the same record as a hand-launched run: run directory, checkpoints
and an MLflow run in the recipe family's experiment, tagged with the search.
Tune only chooses the weights and ranks the results.

Search space, from the command line (`trainlab tune CONFIG --search ...`):
    data.mix.code=0.2:0.8        uniform in [0.2, 0.8]
    data.mix.docs=0.1,0.3,0.5    grid over these values
Weights are normalized to token shares by the loader, so only ratios matter.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainlab.config import ExperimentConfig, load_config
from trainlab.errors import UserError

MIX_PREFIX = "data.mix."
TRIAL_ROUND = 4  # digits of a sampled weight kept in the trial's name and config
DEFAULT_SAMPLES = 4


@dataclass(frozen=True)
class Dimension:
    """One searched weight: uniform in [low, high], or a grid of values."""

    source: str
    low: float = 0.0
    high: float = 0.0
    grid: tuple[float, ...] = ()

    def tune_domain(self) -> Any:
        from ray import tune

        return tune.grid_search(list(self.grid)) if self.grid else tune.uniform(self.low, self.high)


def parse_search(items: tuple[str, ...] | list[str]) -> list[Dimension]:
    """`data.mix.code=0.2:0.8` / `data.mix.code=0.1,0.3` -> Dimensions; UserError otherwise."""
    dims: list[Dimension] = []
    for item in items:
        key, sep, spec = item.partition("=")
        where = f"--search {item!r}"
        if not sep or not key.startswith(MIX_PREFIX) or len(key) == len(MIX_PREFIX):
            raise UserError(f"{where}: expected data.mix.SOURCE=LOW:HIGH or "
                            "data.mix.SOURCE=V1,V2,... (only mix weights are searched)")
        source = key[len(MIX_PREFIX):]
        try:
            if ":" in spec:
                low, high = (float(x) for x in spec.split(":"))
                dim = Dimension(source, low=low, high=high)
                values = (low, high)
                if not low < high:
                    raise UserError(f"{where}: LOW must be < HIGH")
            else:
                values = tuple(float(x) for x in spec.split(","))
                dim = Dimension(source, grid=values)
        except ValueError:
            raise UserError(f"{where}: weights must be numbers") from None
        if any(not math.isfinite(v) or v <= 0 for v in values):
            raise UserError(f"{where}: weights must be finite and > 0")
        if any(d.source == source for d in dims):
            raise UserError(f"{where}: data.mix.{source} is searched twice")
        dims.append(dim)
    if not dims:
        raise UserError("--search: give at least one data.mix.SOURCE to search")
    return dims


def trial_config(base: dict[str, Any], mix: dict[str, float], name: str) -> ExperimentConfig:
    """The config of one trial: the (path-resolved) base config with its mix weights set."""
    d = copy.deepcopy(base)
    d["name"] = name
    d["data"]["mix"] = {src: round(w, TRIAL_ROUND) for src, w in mix.items()}
    return ExperimentConfig.model_validate(d)


def absolute_paths(cfg: ExperimentConfig) -> dict[str, Any]:
    """`cfg` as a dict with data.path and train.runs_root made absolute: Tune runs
    each trial in its own working directory, where relative paths mean nothing."""
    d = cfg.model_dump()
    if "://" not in d["data"]["path"]:
        d["data"]["path"] = str(Path(d["data"]["path"]).resolve())
    if "://" not in d["train"]["runs_root"]:
        d["train"]["runs_root"] = str(Path(d["train"]["runs_root"]).resolve())
    return d


def check_search(cfg: ExperimentConfig, dims: list[Dimension]) -> None:
    """Every searched source must be in the dataset; checked before any trial starts."""
    from trainlab.data import prepare_run_data

    # prepare_run_data validates the mix against the manifest (names, repetition cap).
    for dim in dims:
        probe = dict(cfg.data.mix)
        probe[dim.source] = dim.high or max(dim.grid)
        prepare_run_data(cfg.model_copy(update={"data": cfg.data.model_copy(
            update={"mix": probe})}))


def check_samples(dims: list[Dimension], samples: int | None) -> int:
    """Trials per grid point: `--samples` draws the random (LOW:HIGH) dimensions
    anew for each; a pure grid has nothing to draw, so N samples would be N
    identical trials: refused."""
    if all(d.grid for d in dims):
        if samples not in (None, 1):
            raise UserError(
                f"--samples {samples}: every --search is a grid, so each point would run "
                f"{samples} identical trials; drop --samples or search a LOW:HIGH range"
            )
        return 1
    return samples or DEFAULT_SAMPLES


def default_concurrency(cfg: ExperimentConfig) -> int:
    """Trials that fit the cluster at once (each is a whole Ray Train run of
    resource.num_workers x cpus_per_worker). The embedded local cluster
    advertises more logical CPUs than the machine has (trainlab.raycluster), so
    there the machine's cores count: one trial at a time on a 2-core machine."""
    import ray

    r = cfg.resource
    total = ray.cluster_resources()
    cpus = total.get("CPU", 0) if os.environ.get("RAY_ADDRESS") else (os.cpu_count() or 1)
    fit = int(cpus // max(r.world_size * r.cpus_per_worker, 1e-9))
    if r.use_gpu:
        fit = min(fit, int(total.get("GPU", 0) // r.world_size))
    return max(1, fit)


def objective(result: dict[str, Any], metric: str) -> float:
    """The number a trial is ranked by, from its run summary."""
    if metric == "val_loss":
        value = result.get("val_loss")
    elif metric.startswith("val_loss/"):
        value = (result.get("val_losses") or {}).get(metric.split("/", 1)[1])
    else:
        value = result.get(metric)
    return float(value) if value is not None else math.inf


def run_search(config: str, overrides: tuple[str, ...], dims: list[Dimension], *,
               samples: int | None, metric: str, max_concurrent: int | None,
               seed: int) -> dict[str, Any]:
    """Run the search on Ray Tune; return {"search_id", "metric", "max_concurrent",
    "trials": [...], "best"}. `max_concurrent` None: as many trials as the
    cluster fits (`default_concurrency`)."""
    import uuid

    from ray import tune

    from trainlab.raycluster import ensure_ray

    base = load_config(config, overrides)
    samples = check_samples(dims, samples)
    check_search(base, dims)
    base_dict = absolute_paths(base)
    search_id = uuid.uuid4().hex[:8]
    ensure_ray(base.resource.local_num_cpus)
    concurrent = max_concurrent or default_concurrency(base)

    def trainable(params: dict[str, Any]) -> None:
        from trainlab.train import TrainingFailed, run

        mix = dict(base.data.mix)
        mix.update({d.source: params[d.source] for d in dims})
        tag = "-".join(f"{d.source}{params[d.source]:.3g}" for d in dims)
        cfg = trial_config(base_dict, mix, f"{base.name}-mix-{tag}")
        try:
            summary = run(cfg)
        except TrainingFailed as e:
            summary = e.summary
        tune.report({"objective": objective(summary, metric), "status": summary.get("status"),
                     "run_dir": summary.get("run_dir", ""), "name": cfg.name,
                     **{f"mix.{k}": v for k, v in mix.items()}})

    # The trial's own driver needs almost nothing; its TorchTrainer asks Ray for the
    # workers. A whole CPU per driver would starve the workers on a small cluster.
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"CPU": 0.05}),
        param_space={d.source: d.tune_domain() for d in dims},
        # The limit goes to the search algorithm itself: Tune ignores
        # max_concurrent_trials next to a BasicVariantGenerator (ray/tune/tune.py).
        tune_config=tune.TuneConfig(metric="objective", mode="min", num_samples=samples,
                                    search_alg=_seeded_search(seed, concurrent)),
        run_config=tune.RunConfig(name=f"{base.name}-mix-search-{search_id}",
                                  storage_path=str(Path(base_dict["train"]["runs_root"], "tune")),
                                  verbose=0),
    )
    grid = tuner.fit()
    trials = []
    for r in grid:
        m = r.metrics or {}
        trials.append({
            "name": m.get("name"), "status": m.get("status") or ("error" if r.error else None),
            "objective": m.get("objective"), "run_dir": m.get("run_dir"),
            "mix": {k.removeprefix("mix."): v for k, v in m.items() if k.startswith("mix.")},
            "error": str(r.error).splitlines()[0] if r.error else None,
        })
    trials.sort(key=lambda t: (t["objective"] is None, t["objective"] or 0.0))
    best = trials[0] if trials and trials[0]["objective"] not in (None, math.inf) else None
    return {"search_id": search_id, "metric": metric, "max_concurrent": concurrent,
            "trials": trials, "best": best}


def _seeded_search(seed: int, max_concurrent: int) -> Any:
    from ray.tune.search.basic_variant import BasicVariantGenerator

    return BasicVariantGenerator(random_state=seed, max_concurrent=max_concurrent)
