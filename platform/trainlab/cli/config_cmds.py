"""`trainlab validate | show | plan`: instant, import neither Ray nor torch."""

from __future__ import annotations

import click

from trainlab.cli.common import config_args, echo_json, json_option
from trainlab.config import load_config, to_yaml


@click.command()
@config_args
def validate(config: str, overrides: tuple[str, ...]) -> int:
    """Check CONFIG; print `ok <name>` or every problem (exit 2)."""
    cfg = load_config(config, overrides)
    click.echo(f"ok {cfg.name}")
    return 0


@click.command()
@config_args
def show(config: str, overrides: tuple[str, ...]) -> int:
    """Print the fully resolved CONFIG as YAML."""
    click.echo(to_yaml(load_config(config, overrides)), nl=False)
    return 0


@click.command(name="plan")
@config_args
@json_option
def plan_cmd(config: str, overrides: tuple[str, ...], as_json: bool) -> int:
    """Parameters, memory per device, parallel layout and FLOPs per token of CONFIG.

    Exits 2 when the layout does not fit the devices (after printing the plan)."""
    from trainlab.plan import plan, require_fit

    cfg = load_config(config, overrides)
    p = plan(cfg)
    if as_json:
        echo_json(p.to_json())
    else:
        _print_plan(cfg.name, p)
    require_fit(p)
    return 0


def _print_plan(name: str, p) -> None:  # noqa: ANN001 - Plan, imported lazily
    from rich.console import Console
    from rich.table import Table

    from trainlab.plan.model_math import GiB

    con = Console()
    t = Table(title=f"plan: {name}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    lay = p.parallel
    t.add_row("parameters", f"{p.num_params:,} ({p.num_params / 1e9:.3f} B)")
    t.add_row("world size", str(p.world_size))
    t.add_row("layout", f"{p.strategy}: tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} "
                        f"zero_stage={lay['zero_stage']}")
    for k in ("params", "grads", "optimizer", "activations", "total"):
        t.add_row(f"memory/device {k}", f"{p.memory_per_device_bytes[k] / GiB:.3f} GiB")
    t.add_row("device memory", f"{p.device_memory_bytes / GiB:.2f} GiB "
                               f"(usable {p.usable_memory_bytes / GiB:.2f})")
    t.add_row("micro batch (max that fits)", f"{p.micro_batch_size} ({p.micro_batch_size_max})")
    t.add_row("global batch", f"{p.global_batch_size} seq = {p.tokens_per_step:,} tokens")
    t.add_row("FLOPs per token", f"{p.flops_per_token:.4g}")
    t.add_row("fits", "[green]yes[/]" if p.fits else "[red]NO[/]")
    con.print(t)
    for n in p.notes:
        con.print(f"  - {n}", highlight=False)
