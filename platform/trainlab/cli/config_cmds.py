"""`trainlab validate | show | plan`: instant, import neither Ray nor torch."""

from __future__ import annotations

import click

from trainlab.cli.common import config_args, echo_json, json_option
from trainlab.config import load_config, to_yaml


@click.command()
@config_args
def validate(config: str, overrides: tuple[str, ...]) -> int:
    """Check CONFIG; print `ok <name>` or every problem (exit 2). When the prepared
    dataset at data.path exists, the mix's sources are checked against it too; a
    local dataset or runs root's parent that does not exist is said on stderr
    (`note: ...`: not an error yet, a dataset is often prepared after)."""
    cfg = load_config(config, overrides)
    check_mix_sources(cfg)
    for note in missing_paths(cfg):
        click.echo(f"note: {note}", err=True)
    click.echo(f"ok {cfg.name}")
    return 0


def missing_paths(cfg) -> list[str]:  # noqa: ANN001 - ExperimentConfig
    """The config's local paths that point nowhere: a dataset not there (train
    fails until it is prepared) and a runs root whose parent does not exist (a
    mistyped path; train would make the whole chain). Paths are absolute here
    (load_config anchors them); a store location is left to train."""

    from trainlab.location import locate

    notes = []
    data = locate(cfg.data.path, what="data.path")
    if data.exists_offline() is False:
        notes.append(
            f"data.path = {data.uri}: no such directory (prepare the dataset there with "
            "`trainlab prep SOURCES --out DIR`; train refuses to start without it)"
        )
    root = locate(cfg.train.runs_root, what="train.runs_root")
    if root.parent.exists_offline() is False:
        notes.append(
            f"train.runs_root = {root.uri}: its parent {root.parent.uri} does not exist "
            "(a mistyped path? train would create it)"
        )
    return notes


def check_mix_sources(cfg) -> None:  # noqa: ANN001 - ExperimentConfig
    """Every data.mix source must be in the prepared dataset, when there is one
    here (reads manifest.json only: validate stays instant). A dataset not
    prepared yet is not an error of the config: `train` and `data inspect` say so."""
    from trainlab.data.manifest import load_manifest, resolve_dataset_dir
    from trainlab.data.mix import normalize_mix
    from trainlab.errors import UserError
    from trainlab.location import locate

    if not locate(cfg.data.path, what="data.path").exists_offline("manifest.json"):
        return  # not prepared yet, or in a store (no request: train checks it)
    try:
        root = resolve_dataset_dir(cfg.data.path)
    except UserError:
        return
    sources = load_manifest(root).sources
    normalize_mix(cfg.data.mix, {name: 1 for name in sources})


@click.command()
@config_args
def show(config: str, overrides: tuple[str, ...]) -> int:
    """Print the fully resolved CONFIG as YAML."""
    click.echo(to_yaml(load_config(config, overrides)), nl=False)
    return 0


@click.command(name="plan")
@config_args
@json_option
@click.option(
    "--trace",
    is_flag=True,
    help="Also run one real training step of the planned layout at full size on fake "
    "tensors and a fake process group (no GPU, no memory) and report its traced peak "
    "memory per device next to the estimate. Imports torch; takes seconds.",
)
def plan_cmd(config: str, overrides: tuple[str, ...], as_json: bool, trace: bool) -> int:
    """Parameters, memory per device, parallel layout and FLOPs per token of CONFIG.

    Exits 2 when the layout does not fit the devices (after printing the plan)."""
    from trainlab.plan import plan, require_fit

    cfg = load_config(config, overrides)
    p = plan(cfg)
    out = p.to_json()
    traced = None
    if trace:
        traced = _trace(cfg, p)
        out.update(traced)
    if as_json:
        echo_json(out)
    else:
        _print_plan(cfg.name, p, traced)
    require_fit(p)
    return 0


def _trace(cfg, p) -> dict:  # noqa: ANN001 - ExperimentConfig, Plan, imported lazily
    """`traced_memory_per_device_bytes` (the estimate's categories + total) and
    `estimate_error` (estimate total / traced total - 1) for the plan's layout."""
    from trainlab.plan.planner import Layout, resolve_layout
    from trainlab.train.memtrace import trace_step

    r = trace_step(resolve_layout(cfg, p), Layout(**p.parallel), p.micro_batch_size)
    traced = {k: int(round(v)) for k, v in r.memory.items()}
    estimate = p.memory_per_device_bytes
    traced_total = r.memory["total"]
    if "framework" not in estimate:  # an estimate without the fixed overhead: compare tensors
        traced_total -= r.memory["framework"]
    return {
        "traced_memory_per_device_bytes": traced,
        "estimate_error": round(estimate["total"] / traced_total - 1, 4),
        "trace": {
            "peak_phase": r.phase,
            "seconds": round(r.seconds, 2),
            "world_size": r.world_size,
            "rank": r.rank,  # pp > 1: the busiest pipeline rank (each is traced)
            "notes": r.notes,
        },
    }


def _print_plan(name: str, p, traced: dict | None = None) -> None:  # noqa: ANN001 - Plan
    from rich.table import Table

    from trainlab.cli.common import wide_console
    from trainlab.plan.model_math import GiB

    con = wide_console()  # not wrapped at 80 columns when piped
    t = Table(title=f"plan: {name}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    lay = p.parallel
    t.add_row("parameters", f"{p.num_params:,} ({p.num_params / 1e9:.3f} B)")
    if p.num_params_active:
        t.add_row("active parameters", f"{p.num_params_active:,} per token")
    if p.moe:
        states = sum(p.moe["experts_bytes_per_device"].values())
        t.add_row(
            "routed experts",
            f"{p.moe['experts_params']:,} params, {states / GiB:.3f} GiB/device of model state",
        )
    t.add_row("world size", str(p.world_size))
    t.add_row(
        "layout",
        f"{p.strategy}: tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} "
        f"zero_stage={lay['zero_stage']}",
    )
    mem = p.memory_per_device_bytes
    shown = traced["traced_memory_per_device_bytes"] if traced else {}
    for k, v in mem.items():
        if v or shown.get(k) or k == "total":
            trace_col = f"  (traced {shown[k] / GiB:.3f})" if k in shown else ""
            t.add_row(f"memory/device {k}", f"{v / GiB:.3f} GiB{trace_col}")
    if traced:
        tr = traced["trace"]
        on_rank = f" on rank {tr['rank']}" if p.parallel["pp"] > 1 else ""
        t.add_row(
            "traced peak/device",
            f"{shown['total'] / GiB:.3f} GiB in {tr['peak_phase']}{on_rank} "
            f"({tr['seconds']:.1f} s)",
        )
        t.add_row("estimate error", f"{traced['estimate_error']:+.1%}")
    t.add_row(
        "device memory",
        f"{p.device_memory_bytes / GiB:.2f} GiB (usable {p.usable_memory_bytes / GiB:.2f})",
    )
    t.add_row("micro batch (max that fits)", f"{p.micro_batch_size} ({p.micro_batch_size_max})")
    t.add_row("global batch", f"{p.global_batch_size} seq = {p.tokens_per_step:,} tokens")
    t.add_row("FLOPs per token", f"{p.flops_per_token:.4g}")
    t.add_row("fits", "[green]yes[/]" if p.fits else "[red]NO[/]")
    con.print(t)
    for n in p.notes:
        con.print(f"  - {n}", highlight=False)
    for n in traced["trace"]["notes"] if traced else []:
        con.print(f"  - trace: {n}", highlight=False)
