"""Confirming a proposal: the proposed and a baseline mixture trained side by side.

Both run at the target config (or, with `scale="proxy"`, at the swarm's proxy
config, where the law's predictions live and the best swarm trial is a fair
baseline), `repeats` times each with different seeds (train.seed and
data.seed), so the gap between them can be read against the run-to-run noise.
The runs are Ray Tune trials nested under the swarm's MLflow parent run, and
the result is added to the parent run and the swarm record.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from trainlab.config import ExperimentConfig
from trainlab.errors import UserError
from trainlab.mix import record as records
from trainlab.mix.fit import dataset, fit_law
from trainlab.mix.targets import parse_target


def load_proposal(path: str | Path) -> dict[str, Any]:
    """The sidecar `<recipe>.proposal.json` written by `mix propose` next to the recipe."""
    path = Path(path)
    sidecar = path if path.name.endswith(".proposal.json") else path.with_suffix(".proposal.json")
    if not sidecar.exists():
        raise UserError(f"{path}: no {sidecar.name} beside it; PROPOSAL is the recipe written "
                        "by `trainlab mix propose --out`")
    return json.loads(sidecar.read_text())


def baseline_mix(spec: str, record: dict[str, Any], proposal: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """BASELINE_MIX: `base` (the target config's mix), `natural` (token shares), `best`
    (the swarm's best trial for the target), or SOURCE=W,SOURCE=W."""
    sources = record["sources"]
    if spec == "base":
        mix = record["target_config"]["data"]["mix"] or record["train_tokens"]
    elif spec == "natural":
        mix = record["train_tokens"]
    elif spec == "best":
        mix = proposal["best_trial"]["mix"]
    else:
        mix = {}
        for part in spec.split(","):
            k, sep, v = part.partition("=")
            try:
                mix[k.strip()] = float(v)
            except ValueError:
                sep = ""
            if not sep or mix[k.strip()] <= 0:
                raise UserError(f"--against {spec!r}: expected base, natural, best or "
                                "SOURCE=W,SOURCE=W with weights > 0")
    unknown = [s for s in mix if s not in sources]
    if unknown:
        raise UserError(f"--against {spec!r}: {unknown} not among the swarm's sources {sources}")
    total = sum(float(mix.get(s, 0.0)) for s in sources)
    return spec, {s: round(float(mix.get(s, 0.0)) / total, 4) for s in sources if mix.get(s)}


def _configs(base: dict[str, Any], mix: dict[str, float], name: str, repeats: int,
             experiment: str) -> list[dict[str, Any]]:
    out = []
    for r in range(repeats):
        d = json.loads(json.dumps(base))
        d["name"] = f"{name}-r{r}"
        d["data"]["mix"] = mix
        d["data"]["seed"] = base["data"]["seed"] + r
        d["train"]["seed"] = base["train"]["seed"] + r
        d["tracking"]["experiment"] = experiment
        out.append(ExperimentConfig.model_validate(d).model_dump())
    return out


def tag_group(uri: str, exp_id: str, config: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The runs of one arm's repeats (seeds of one experiment) as a group
    (trainlab.repeats): group_id, group_index, group_size and experiment_key tags on
    their MLflow runs, so `trainlab compare GROUP_A GROUP_B` gives each arm's mean
    and std with n, and the gap with its interval and verdict (docs/noise.md).
    Returns the group id (runs that left no record are left out of the tags)."""
    import uuid

    from trainlab.config import flatten
    from trainlab.repeats import experiment_key
    from trainlab.track.backend import client_for
    from trainlab.track.mlflow_cb import run_key

    group_id = uuid.uuid4().hex[:12]
    key = experiment_key(flatten(ExperimentConfig.model_validate(config).model_dump(mode="json")))
    client = client_for(uri)
    for index, row in enumerate(rows):
        if not row.get("run_dir"):
            continue
        found = client.search_runs(
            [exp_id], filter_string=f"tags.run_key = '{run_key(row['run_dir'])}'", max_results=1
        )
        for run in found:
            for tag, value in (("group_id", group_id), ("group_index", str(index)),
                               ("group_size", str(len(rows))), ("experiment_key", key)):
                client.set_tag(run.info.run_id, tag, value)
    return group_id


def confirm(proposal_path: str, against: str, *, scale: str = "target", repeats: int = 1,
            max_concurrent: int | None = None) -> dict[str, Any]:
    from trainlab.mix.swarm import concurrency, log_to_parent, run_trials
    from trainlab.raycluster import ensure_ray
    from trainlab.track.backend import client_for, get_or_create_experiment

    proposal = load_proposal(proposal_path)
    record = records.load(proposal["swarm_id"], proposal["runs_root"])
    target = parse_target(proposal["target"], record["sources"])
    label, base_mix = baseline_mix(against, record, proposal)
    base = record["target_config" if scale == "target" else "proxy_config"]
    stamp = time.strftime("%H%M%S", time.gmtime())
    prefix = f"{base['name']}-swarm-{record['swarm_id']}-confirm-{stamp}"
    configs = (_configs(base, proposal["mix"], f"{prefix}-proposal", repeats, record["experiment"])
               + _configs(base, base_mix, f"{prefix}-baseline", repeats, record["experiment"]))
    cfg0 = ExperimentConfig.model_validate(configs[0])
    ensure_ray(cfg0.resource.local_num_cpus)
    from trainlab.track import artifact_location, tracking_uri

    uri = tracking_uri(record["runs_root"])
    exp_id = get_or_create_experiment(client_for(uri), record["experiment"],
                                      artifact_location(record["runs_root"]))
    started = time.time()
    results = run_trials(configs, prefix, concurrency(cfg0, max_concurrent), uri, exp_id,
                         record["parent_run_id"], record["swarm_id"])
    X, y, _ = dataset(record, target)
    law = fit_law(proposal["model"], record["sources"], X, y)

    def arm(mix: dict[str, float], rows: list[dict[str, Any]]) -> dict[str, Any]:
        values = [target.value(r["metrics"]) for r in rows]
        got = [v for v in values if v is not None]
        w = np.array([[mix.get(s, 0.0) for s in record["sources"]]])
        return {"mix": mix, "predicted": float(law.predict(w)[0]),
                "observed": statistics.fmean(got) if got else None,
                "observed_std": statistics.stdev(got) if len(got) > 1 else None,
                "values": values, "runs": [r["run_dir"] for r in rows],
                "status": [r["status"] for r in rows]}

    prop, bl = arm(proposal["mix"], results[:repeats]), arm(base_mix, results[repeats:])
    if repeats > 1:  # each arm's seeds as a group: `trainlab compare` shows the bands
        prop["group_id"] = tag_group(uri, exp_id, configs[0], results[:repeats])
        bl["group_id"] = tag_group(uri, exp_id, configs[repeats], results[repeats:])
    noise = [x for x in (prop["observed_std"], bl["observed_std"]) if x is not None]
    out = {
        "swarm_id": record["swarm_id"], "target": target.text, "scale": scale,
        "against": label, "repeats": repeats, "proposal": prop, "baseline": bl,
        "improvement": (bl["observed"] - prop["observed"])
        if prop["observed"] is not None and bl["observed"] is not None else None,
        "noise_std": statistics.fmean(noise) if noise else None,
        "wall_s": round(time.time() - started, 1),
        "predicted_scale": "proxy",
    }
    if scale == "target":
        walls = [r["wall_s"] for r in results if r.get("wall_s")]
        if walls:
            from trainlab.mix.cost import measured

            record["cost"] = measured(record["cost"], record["trials"],
                                      record["cost"]["swarm_wall_s"], statistics.fmean(walls))
            out["swarm_cost"] = record["cost"]
    record["confirmations"].append(out)
    records.save(record)
    tag = f"confirm.{scale}"
    log_to_parent(record, {f"{tag}.proposal.observed": prop["observed"] or float("nan"),
                           f"{tag}.baseline.observed": bl["observed"] or float("nan"),
                           f"{tag}.proposal.predicted": prop["predicted"],
                           f"{tag}.baseline.predicted": bl["predicted"]},
                  {f"{tag}.against": label, f"{tag}.target": target.text})
    return out
