"""`trainlab tune CONFIG --search data.mix.SRC=LOW:HIGH ... [--samples N] [--json]`."""

from __future__ import annotations

import click

from trainlab.cli.common import config_args, echo_json, json_option, wide_console


@click.command()
@config_args
@click.option("--search", "search", multiple=True, required=True, metavar="data.mix.SRC=SPEC",
              help="A mix weight to search: LOW:HIGH (uniform) or V1,V2,... (grid). Repeatable.")
@click.option("--samples", type=click.IntRange(1, 10_000), default=None,
              help="Draws of the LOW:HIGH dimensions per grid point (default 4; "
              "refused when every --search is a grid: the trials would be identical).")
@click.option("--metric", default="val_loss", show_default=True,
              help="Rank trials by this run-summary value: val_loss, val_loss/SOURCE, final_loss.")
@click.option("--max-concurrent", type=click.IntRange(1, 1000), default=None,
              help="Trials running at once (each is a full Ray Train run); default: as "
              "many as the cluster's resources fit (one at a time on a 2-core machine).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampler.")
@json_option
def tune(config: str, overrides: tuple[str, ...], search: tuple[str, ...], samples: int | None,
         metric: str, max_concurrent: int | None, seed: int, as_json: bool) -> int:
    """Search data-mix weights of CONFIG with Ray Tune; one trial = one trainlab run."""
    from trainlab.raycluster import command_log, route_ray_output
    from trainlab.track.server import check_credentials
    from trainlab.tune import parse_search, run_search

    check_credentials()  # a tracking server refusing them: said before any trial starts
    route_ray_output(command_log("tune"))  # the terminal keeps trainlab's lines
    dims = parse_search(search)
    result = run_search(config, overrides, dims, samples=samples, metric=metric,
                        max_concurrent=max_concurrent, seed=seed)
    if as_json:
        echo_json(result)
    else:
        _print(result)
    return 0 if result["best"] else 1


def _print(result: dict) -> None:
    from rich.table import Table

    t = Table(title=f"mix search {result['search_id']} (by {result['metric']}, lower is better)",
              title_justify="left")
    for col in ("rank", "run", "status", result["metric"], "mix"):
        t.add_column(col)
    for i, tr in enumerate(result["trials"], 1):
        mix = ", ".join(f"{k}={v:.3g}" for k, v in sorted(tr["mix"].items()))
        obj = tr["objective"]
        t.add_row(str(i), str(tr["name"]), str(tr["status"]),
                  "-" if obj is None else f"{obj:.4f}", mix)
    wide_console().print(t)
    if result["best"]:
        print(f"best: {result['best']['name']} ({result['best']['run_dir']})")
