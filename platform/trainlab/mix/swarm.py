"""A swarm: N proxy runs on sampled mixtures, as Ray Tune trials.

Each trial is an ordinary trainlab run of the proxy config (`trainlab.train.run`,
one TorchTrainer per trial as Ray Train V2 wants, the same path as `trainlab
tune`): its own run directory, checkpoints and MLflow run. The swarm adds one
MLflow parent run (experiment `{proxy name}-swarm-{id}`) with the trials nested
under it (`mlflow.parentRunId`), and the record on disk (`trainlab.mix.record`).
A trial that raises is retried once by Tune, then recorded as an error; a run
that fails for good is recorded as failed. Neither stops the swarm.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainlab.config import ExperimentConfig, config_hash, load_config
from trainlab.errors import UserError
from trainlab.mix import cost as costs
from trainlab.mix import record as records
from trainlab.mix.sampling import Budget, SampleSet, sample_mixtures
from trainlab.runstatus import RunStatus

log = logging.getLogger(__name__)

# Config keys a reused swarm may differ in (besides the mix): what names and records a run.
_NOT_COMPARED = ("name", "tracking", "purpose", "expectation", "owner")


def load_pair(config: str, overrides: tuple[str, ...],
              proxy: tuple[str, ...]) -> tuple[ExperimentConfig, ExperimentConfig]:
    """(target, proxy) configs. `proxy` is a config file, or KEY=VALUE overrides applied
    on top of the target (e.g. `--proxy train.total_steps=20 --proxy model.num_layers=1`);
    none means the proxy is the target itself."""
    target = load_config(config, overrides)
    if not proxy:
        return target, target
    sets = [p for p in proxy if "=" in p]
    if sets and len(sets) != len(proxy) or (not sets and len(proxy) != 1):
        raise UserError("--proxy: give one proxy config file, or KEY=VALUE overrides of CONFIG")
    if sets:
        return target, load_config(config, (*overrides, *sets))
    return target, load_config(proxy[0])


def source_tokens(cfg: ExperimentConfig) -> dict[str, int]:
    """Training tokens (after the validation hold-out) of the sources `cfg` mixes:
    the keys of data.mix, or every non-empty source of the dataset."""
    from trainlab.data import prepare_run_data

    mix = {s: 1.0 for s in cfg.data.mix}
    probe = cfg.model_copy(update={
        "data": cfg.data.model_copy(update={"mix": mix}),
        "train": cfg.train.model_copy(update={"total_steps": 1})})
    spec = prepare_run_data(probe)
    return dict(zip(spec.sources, spec.train_tokens, strict=True))


def budget(cfg: ExperimentConfig) -> Budget:
    from trainlab.plan import resolve_layout

    r = resolve_layout(cfg)
    return Budget(seq_len=r.data.seq_len, total_rows=r.train.total_steps * r.global_batch_size,
                  total_steps=r.train.total_steps, max_epochs=r.data.max_epochs_per_source)


def trial_cpus(cfg: ExperimentConfig) -> float:
    """Logical CPUs one trial holds: its Ray Train workers and its Ray Data loader."""
    return cfg.resource.world_size * cfg.resource.cpus_per_worker + cfg.data.loader_cpus


def concurrency(cfg: ExperimentConfig, max_concurrent: int | None) -> int:
    """Trials at once: as many as the cluster's CPUs hold (capped by `max_concurrent`)."""
    import ray

    fit = int(ray.cluster_resources().get("CPU", 1) // trial_cpus(cfg))
    return max(1, min(fit, max_concurrent) if max_concurrent else fit)


def _comparable(cfg: ExperimentConfig) -> dict[str, Any]:
    d = cfg.model_dump(mode="json")
    for k in _NOT_COMPARED:
        d.pop(k, None)
    d["data"].pop("mix", None)
    d["data"].pop("path", None)
    d["train"].pop("runs_root", None)
    return d


def reusable_trials(old: dict[str, Any], proxy: ExperimentConfig,
                    sources: list[str]) -> list[dict[str, Any]]:
    """The completed trials of an earlier swarm that this swarm's fit can use: same
    proxy (but for the mix), sources a subset of this swarm's (new ones weigh 0)."""
    missing = [s for s in old["sources"] if s not in sources]
    if missing:
        raise UserError(f"--reuse {old['swarm_id']}: its sources {missing} are not mixed "
                        f"here ({', '.join(sources)}); reuse is for adding sources")
    old_proxy = ExperimentConfig.model_validate(old["proxy_config"])
    if _comparable(old_proxy) != _comparable(proxy):
        from trainlab.config import flatten

        a, b = flatten(_comparable(old_proxy)), flatten(_comparable(proxy))
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        raise UserError(f"--reuse {old['swarm_id']}: its proxy differs from this one in "
                        f"{', '.join(diff[:8])}; only runs of the same proxy can be reused")
    out = []
    for t in old["trials"]:
        if t.get("status") == RunStatus.COMPLETED and t.get("metrics"):
            mix = {s: float(t["mix"].get(s, 0.0)) for s in sources}
            out.append({**t, "mix": mix, "reused_from": old["swarm_id"]})
    return out


def _nest(uri: str, experiment_id: str, run_dir: str, parent_id: str, swarm_id: str) -> None:
    """Put a trial's MLflow run under the swarm's parent run (best effort: logged)."""
    try:
        from trainlab.track.backend import client_for
        from trainlab.track.mlflow_cb import run_key

        client = client_for(uri)
        found = client.search_runs([experiment_id],
                                   filter_string=f"tags.run_key = '{run_key(run_dir)}'",
                                   max_results=1)
        for r in found:
            client.set_tag(r.info.run_id, "mlflow.parentRunId", parent_id)
            client.set_tag(r.info.run_id, "mix.swarm_id", swarm_id)
    except Exception as e:  # noqa: BLE001 - the run itself is recorded either way
        log.warning("could not nest %s under the swarm's MLflow run: %s", run_dir, e)


def start_parent(runs_root: str, experiment: str, name: str, swarm_id: str,
                 tags: dict[str, str], proxy: ExperimentConfig | None = None) -> tuple[str, str, str]:
    """Create the swarm's MLflow parent run; returns (uri, experiment_id, run_id).
    It carries a `run_key` (of the swarm directory) so `trainlab runs/compare` list it,
    and the proxy's params but its mix, so that compare shows the trials differing in
    their mix only."""
    from mlflow.entities import Param

    from trainlab.config import flatten
    from trainlab.track import artifact_location, tracking_uri
    from trainlab.track.backend import client_for, get_or_create_experiment
    from trainlab.track.mlflow_cb import param_value, run_key

    uri = tracking_uri(runs_root)
    client = client_for(uri)
    exp_id = get_or_create_experiment(client, experiment, artifact_location(runs_root))
    run = client.create_run(exp_id, run_name=name, tags={
        "mix.swarm_id": swarm_id, "run_key": run_key(str(records.swarm_dir(runs_root, swarm_id))),
        "run_dir": str(records.swarm_dir(runs_root, swarm_id)), "status": "running", **tags})
    if proxy is not None:
        flat = flatten(proxy.model_dump(mode="json"))
        params = [Param(k, param_value(v)) for k, v in flat.items()
                  if not k.startswith("data.mix") and k != "name"]
        for i in range(0, len(params), 100):
            client.log_batch(run.info.run_id, params=params[i:i + 100])
    return uri, exp_id, run.info.run_id


def run_swarm(config: str, overrides: tuple[str, ...], proxy: tuple[str, ...], *, runs: int,
              concentration: float = 5.0, seed: int = 0, max_concurrent: int | None = None,
              reuse: str | None = None,
              say: Callable[[str], None] = print) -> dict[str, Any]:
    """Sample, train and record a swarm; returns its record (also in swarm.json)."""
    from trainlab.raycluster import ensure_ray
    from trainlab.tune import absolute_paths

    target, proxy_cfg = load_pair(config, overrides, proxy)
    tokens = source_tokens(proxy_cfg)
    sources = list(tokens)
    proxy_dict = absolute_paths(proxy_cfg)
    runs_root = proxy_dict["train"]["runs_root"]
    reused: list[dict[str, Any]] = []
    if reuse:
        reused = reusable_trials(records.load(reuse, runs_root), proxy_cfg, sources)
        reused = reused[: runs // 2]
    to_run = runs - len(reused)
    samples: SampleSet = sample_mixtures(tokens, to_run, budget(proxy_cfg),
                                         concentration=concentration, seed=seed)
    swarm_id = uuid.uuid4().hex[:8]
    experiment = f"{proxy_cfg.name}-swarm-{swarm_id}"
    proxy_dict["tracking"]["experiment"] = experiment

    ensure_ray(proxy_cfg.resource.local_num_cpus)
    parallel = concurrency(proxy_cfg, max_concurrent)
    cost = costs.estimate(proxy_cfg, target, to_run, parallel)
    say(f"swarm {swarm_id}: {to_run} proxy runs of {proxy_cfg.name} over {', '.join(sources)}"
        f" ({len(reused)} reused from {reuse}), {parallel} at once" if reuse else
        f"swarm {swarm_id}: {to_run} proxy runs of {proxy_cfg.name} over {', '.join(sources)},"
        f" {parallel} at once")
    say(f"cost: {cost['swarm_flops']:.3g} FLOPs = {cost['flops_fraction']:.3g} x the target "
        f"run's {cost['target_flops']:.3g} ({target.name}); wall time ~{cost['wall_fraction_estimate']:.3g}"
        " x the target's (estimate)")
    if samples.rejected:
        say(f"rejected {samples.rejected} sampled mixtures over data.max_epochs_per_source "
            f"(e.g. {samples.rejected_examples[0]['reason']})")

    record: dict[str, Any] = {
        "swarm_id": swarm_id, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs_root": runs_root, "config": str(Path(config).resolve()), "overrides": list(overrides),
        "proxy": list(proxy), "experiment": experiment,
        "target_config": absolute_paths(target), "proxy_config": proxy_dict,
        "proxy_config_hash": config_hash(proxy_cfg), "target_config_hash": config_hash(target),
        "sources": sources, "train_tokens": tokens,
        "sampling": {"concentration": concentration, "seed": seed, "requested": to_run,
                     "rejected": samples.rejected, "rejected_examples": samples.rejected_examples},
        "concurrency": parallel, "reuse": {"from": reuse, "reused": len(reused)} if reuse else None,
        "cost": cost, "status": "running", "trials": [], "fits": {}, "proposals": [],
        "confirmations": [],
    }
    uri, exp_id, parent_id = start_parent(runs_root, experiment, f"{proxy_cfg.name}-swarm-{swarm_id}",
                                          swarm_id, {"mix.target": target.name}, proxy_cfg)
    record["parent_run_id"] = parent_id
    records.save(record)
    started = time.time()
    from trainlab.tune import trial_config

    configs = [trial_config(proxy_dict, m, f"{proxy_cfg.name}-swarm-{swarm_id}-{i:03d}").model_dump()
               for i, m in enumerate(samples.mixes)]
    results = run_trials(configs, f"{proxy_cfg.name}-swarm-{swarm_id}", parallel, uri, exp_id,
                         parent_id, swarm_id)
    trials = reused + [{**r, "kind": samples.kinds[r["trial"]]} for r in results]
    record["trials"] = trials
    record["cost"] = costs.measured(cost, trials, time.time() - started)
    ok = sum(t["status"] == "completed" for t in trials if not t.get("reused_from"))
    record["status"] = "completed"
    record["completed"], record["failed"] = ok, len(results) - ok
    path = records.save(record)
    _finish_parent(uri, parent_id, record, path)
    return record


def run_trials(configs: list[dict[str, Any]], tune_name: str, parallel: int, uri: str,
               exp_id: str, parent_id: str, swarm_id: str) -> list[dict[str, Any]]:
    """Train each config (a resolved, path-absolute config dict) as one Ray Tune trial,
    `parallel` at once, each nested under `parent_id`; one result per config, in order."""
    from ray import tune

    def trainable(params: dict[str, Any]) -> None:
        from trainlab.mix.targets import trial_metrics
        from trainlab.train import TrainingFailed, run

        i = params["trial"]
        cfg = ExperimentConfig.model_validate(configs[i])
        t0 = time.time()
        try:
            summary = run(cfg)
        except TrainingFailed as e:
            summary = e.summary
        if summary.get("run_dir"):
            _nest(uri, exp_id, summary["run_dir"], parent_id, swarm_id)
        tune.report({"trial": i, "status": summary.get("status"), "name": cfg.name,
                     "run_dir": str(summary.get("run_dir") or ""),
                     "wall_s": round(time.time() - t0, 2),
                     "metrics_json": json.dumps(trial_metrics(summary))})

    tuner = tune.Tuner(
        # The trial's own driver needs almost nothing; its TorchTrainer asks for the workers.
        tune.with_resources(trainable, {"CPU": 0.05}),
        param_space={"trial": tune.grid_search(list(range(len(configs))))},
        tune_config=tune.TuneConfig(max_concurrent_trials=parallel),
        run_config=tune.RunConfig(name=tune_name,
                                  storage_path=str(Path(configs[0]["train"]["runs_root"], "tune")),
                                  failure_config=tune.FailureConfig(max_failures=1), verbose=0),
    )
    out = []
    for r in tuner.fit():
        m, i = r.metrics or {}, (r.config or {}).get("trial")
        out.append({
            "trial": i, "mix": configs[i]["data"]["mix"], "name": m.get("name") or configs[i]["name"],
            "status": m.get("status") or "error", "run_dir": m.get("run_dir") or None,
            "wall_s": m.get("wall_s"), "metrics": json.loads(m.get("metrics_json") or "{}"),
            "error": str(r.error).splitlines()[0] if r.error else None,
        })
    return sorted(out, key=lambda t: t["trial"])


def _finish_parent(uri: str, parent_id: str, record: dict[str, Any], path: Path) -> None:
    from trainlab.track.backend import client_for

    client = client_for(uri)
    c = record["cost"]
    for k in ("flops_fraction", "wall_fraction", "swarm_flops", "target_flops", "swarm_wall_s"):
        if isinstance(c.get(k), (int, float)) and math.isfinite(c[k]):
            client.log_metric(parent_id, f"cost.{k}", float(c[k]))
    client.log_metric(parent_id, "trials.completed", record["completed"])
    client.log_metric(parent_id, "trials.failed", record["failed"])
    client.set_tag(parent_id, "mix.sources", ",".join(record["sources"]))
    client.set_tag(parent_id, "mix.runs", str(len(record["trials"])))
    client.set_tag(parent_id, "mix.concentration", str(record["sampling"]["concentration"]))
    client.set_tag(parent_id, "status", record["status"])
    client.log_artifact(parent_id, str(path))
    client.set_terminated(parent_id, "FINISHED")


def log_to_parent(record: dict[str, Any], metrics: dict[str, float], tags: dict[str, str],
                  files: list[Path] = ()) -> None:
    """Add what fit/propose/confirm found to the swarm's parent run."""
    from trainlab.track import tracking_uri
    from trainlab.track.backend import client_for

    client = client_for(tracking_uri(record["runs_root"]))
    pid = record["parent_run_id"]
    for k, v in metrics.items():
        if v is not None and math.isfinite(v):
            client.log_metric(pid, k, float(v))
    for k, v in tags.items():
        client.set_tag(pid, k, v)
    for f in files:
        client.log_artifact(pid, str(f))
