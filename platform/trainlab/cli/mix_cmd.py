"""`trainlab mix swarm|fit|propose|confirm`: find a data mix with a swarm of proxies.

Each subcommand's `--json` prints one JSON object as the last stdout line.
"""

from __future__ import annotations

from typing import Any

import click

from trainlab.cli.common import (
    config_args,
    default_runs_root,
    echo_json,
    json_option,
    runs_root_option,
)


def _runs_root(fn: Any) -> Any:
    return runs_root_option("The runs root the swarm was recorded in (train.runs_root).")(fn)


def _target(fn: Any) -> Any:
    return click.option("--target", "target", default="val_loss", show_default=True,
                        help="val_loss, val_loss/SOURCE, or W*val_loss/A+W*val_loss/B.")(fn)


@click.group()
def mix() -> None:
    """Mixture laws: proxy swarms on Ray Tune, a fitted law, a proposal, its confirmation."""


@mix.command()
@config_args
@click.option("--proxy", "proxy", multiple=True, metavar="PROXY_CONFIG|KEY=VALUE",
              help="The proxy: a config file, or KEY=VALUE overrides of CONFIG (repeatable). "
                   "Default: CONFIG itself.")
@click.option("--runs", type=click.IntRange(1, 100_000), required=True,
              help="Mixtures in the swarm (reused ones included).")
@click.option("--concentration", type=float, default=5.0, show_default=True,
              help="Dirichlet concentration around the natural token shares (lower = wider).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampler.")
@click.option("--max-concurrent", type=click.IntRange(1, 10_000), default=None,
              help="Cap on trials at once (default: as many as the cluster's CPUs hold).")
@click.option("--reuse", "reuse", default=None, metavar="SWARM_ID",
              help="An earlier swarm over fewer sources: reuse its runs, run only new ones.")
@json_option
def swarm(config: str, overrides: tuple[str, ...], proxy: tuple[str, ...], runs: int,
          concentration: float, seed: int, max_concurrent: int | None, reuse: str | None,
          as_json: bool) -> int:
    """Train RUNS proxies of CONFIG on sampled mixtures, as Ray Tune trials."""
    from trainlab.mix.swarm import run_swarm
    from trainlab.raycluster import command_log, route_ray_output

    route_ray_output(command_log("mix-swarm"))  # the terminal keeps trainlab's lines

    rec = run_swarm(config, overrides, proxy, runs=runs, concentration=concentration, seed=seed,
                    max_concurrent=max_concurrent, reuse=reuse,
                    say=lambda m: click.echo(m, err=as_json))
    out = swarm_summary(rec)
    if as_json:
        echo_json(out)
    else:
        for t in rec["trials"]:
            mix_text = ", ".join(f"{k}={v:.3f}" for k, v in t["mix"].items())
            loss = t.get("metrics", {}).get("val_loss")
            click.echo(f"{t.get('name') or t['trial']!s:32} {t['status']:10} "
                       f"val_loss={'-' if loss is None else f'{loss:.4f}'}  {mix_text}")
        c = rec["cost"]
        click.echo(f"swarm {rec['swarm_id']}: {out['completed']} completed, {out['failed']} "
                   f"failed, {out['reused']} reused; {c.get('swarm_wall_s')} s; FLOPs "
                   f"{c['flops_fraction']:.3g} x target, wall {c.get('wall_fraction', float('nan')):.3g}"
                   f" x target; record {out['record']}")
    return 0 if out["completed"] else 1


def swarm_summary(rec: dict[str, Any]) -> dict[str, Any]:
    from trainlab.mix.record import swarm_dir

    return {
        "swarm_id": rec["swarm_id"], "n_runs": len(rec["trials"]), "completed": rec["completed"],
        "failed": rec["failed"], "reused": sum(bool(t.get("reused_from")) for t in rec["trials"]),
        "rejected": rec["sampling"]["rejected"], "sources": rec["sources"],
        "experiment": rec["experiment"], "parent_run_id": rec["parent_run_id"],
        "cost": rec["cost"], "record": str(swarm_dir(rec["runs_root"], rec["swarm_id"]) / "swarm.json"),
        "trials": [{k: t.get(k) for k in ("trial", "name", "status", "mix", "metrics", "run_dir",
                                           "wall_s", "reused_from")} for t in rec["trials"]],
    }


@mix.command()
@click.argument("swarm_id")
@_target
@click.option("--model", default=None, help="Fit only this model (loglinear, logweights, "
              "quadratic, gbm); default: all, the best by cross-validated Spearman.")
@_runs_root
@json_option
def fit(swarm_id: str, target: str, model: str | None, runs_root: str | None, as_json: bool) -> int:
    """Fit the mixture law of TARGET to the swarm's runs; cross-validated quality per model."""
    from trainlab.mix.api import run_fit

    res = run_fit(swarm_id, target, model, default_runs_root(runs_root))
    out = {k: res[k] for k in ("swarm_id", "target", "n_runs", "models", "best_model",
                               "sensitivities")}
    if as_json:
        echo_json(out)
        return 0
    click.echo(f"swarm {swarm_id}, target {target}, {res['n_runs']} runs (observed "
               f"{res['target_range'][0]:.4f} .. {res['target_range'][1]:.4f})")
    for name, m in res["models"].items():
        mark = "  <- best" if name == res["best_model"] else ""
        click.echo(f"  {name:11} spearman_cv {m['spearman_cv']:6.3f}  rmse_cv {m['rmse_cv']:.4f}{mark}")
    sens = ", ".join(f"{s} {v:+.3f}" for s, v in res["sensitivities"].items())
    click.echo(f"sensitivity (d target / d share moved toward the source): {sens}")
    return 0


@mix.command()
@click.argument("swarm_id")
@_target
@click.option("--min", "low", type=click.FloatRange(0.0, 1.0), default=0.01, show_default=True,
              help="Lowest weight of any source.")
@click.option("--max", "high", type=click.FloatRange(0.0, 1.0), default=1.0, show_default=True,
              help="Highest weight of any source (the target run's repetition caps also apply).")
@click.option("--model", default=None, help="The law to optimise (default: the best fit).")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Recipe override to write (default: in the swarm's directory).")
@_runs_root
@json_option
def propose(swarm_id: str, target: str, low: float, high: float, model: str | None,
            out: str | None, runs_root: str | None, as_json: bool) -> int:
    """Optimise the fitted law under bounds and the target run's caps; write a recipe."""
    from trainlab.mix.api import run_propose

    p = run_propose(swarm_id, target, low=low, high=high, model=model, out=out,
                    runs_root=default_runs_root(runs_root))
    if as_json:
        echo_json({k: p[k] for k in ("swarm_id", "target", "mix", "predicted",
                                     "predicted_interval", "swarm_cost_fraction", "model",
                                     "recipe", "best_trial")})
        return 0
    mix_text = ", ".join(f"{s}={w:.4f}" for s, w in p["mix"].items())
    lo, hi = p["predicted_interval"]
    click.echo(f"proposal ({p['model']} law): {mix_text}")
    click.echo(f"predicted {target} {p['predicted']:.4f} (90% bootstrap {lo:.4f} .. {hi:.4f}); "
               f"best trial observed {p['best_trial']['observed']:.4f}")
    click.echo(f"recipe: {p['recipe']}  (swarm cost: {p['swarm_cost_fraction']:.3g} x the "
               "target run's FLOPs)")
    return 0


@mix.command()
@click.argument("proposal", type=click.Path(dir_okay=False))
@click.option("--against", "against", required=True, metavar="BASELINE_MIX",
              help="base (the config's mix), natural, best (best swarm trial) or SRC=W,SRC=W.")
@click.option("--scale", type=click.Choice(["target", "proxy"]), default="target",
              show_default=True, help="Train both at the target config or at the proxy's.")
@click.option("--repeats", type=click.IntRange(1, 100), default=1, show_default=True,
              help="Runs per mixture (seeds differ) to measure run-to-run noise.")
@click.option("--max-concurrent", type=click.IntRange(1, 10_000), default=None,
              help="Cap on runs at once (default: as many as the cluster's CPUs hold).")
@json_option
def confirm(proposal: str, against: str, scale: str, repeats: int, max_concurrent: int | None,
            as_json: bool) -> int:
    """Train the proposal and BASELINE_MIX; predicted vs observed, in the swarm's parent run."""
    from trainlab.mix.confirm import confirm as run_confirm
    from trainlab.raycluster import command_log, route_ray_output

    route_ray_output(command_log("mix-confirm"))  # the terminal keeps trainlab's lines

    r = run_confirm(proposal, against, scale=scale, repeats=repeats,
                    max_concurrent=max_concurrent)
    if as_json:
        echo_json(r)
    else:
        for arm in ("proposal", "baseline"):
            a = r[arm]
            obs = "-" if a["observed"] is None else f"{a['observed']:.4f}"
            std = "" if a["observed_std"] is None else f" +- {a['observed_std']:.4f}"
            click.echo(f"{arm:9} observed {obs}{std}  predicted (proxy scale) "
                       f"{a['predicted']:.4f}  mix {a['mix']}")
        if r["improvement"] is not None:
            click.echo(f"improvement over {r['against']}: {r['improvement']:+.4f} "
                       f"{r['target']} at {r['scale']} scale")
        groups = [r[arm].get("group_id") for arm in ("baseline", "proposal")]
        if all(groups):  # the repeats of each arm are a group: bands and a verdict
            click.echo(f"against the noise: trainlab compare {groups[0]} {groups[1]}")
    ok = r["proposal"]["observed"] is not None and r["baseline"]["observed"] is not None
    return 0 if ok else 1
