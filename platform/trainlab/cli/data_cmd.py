"""`trainlab data inspect`: the mixed, packed stream of a config, without training."""

from __future__ import annotations

from typing import Any

import click

from trainlab.cli.common import config_args, echo_json, json_option, wide_console
from trainlab.config import load_config


@click.group()
def data() -> None:
    """Inspect the mixed, packed training stream."""


@data.command()
@config_args
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Global steps (of the configured global batch) to deliver.",
)
@json_option
def inspect(config: str, overrides: tuple[str, ...], steps: int, as_json: bool) -> int:
    """Run the loader of CONFIG for STEPS steps and report, per source, the target
    weight, delivered token share, documents used and epochs consumed; the padding
    fraction, documents split and tokens/s delivered."""
    from trainlab.data.inspect import inspect_stream

    cfg = load_config(config, overrides)
    report = inspect_stream(cfg, steps)
    if as_json:
        echo_json(report)
    else:
        _print_report(cfg.name, report)
    return 0


def _print_report(name: str, r: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(
        title=f"data stream: {name} ({r['steps']} steps x {r['global_batch_size']} rows "
        f"x {r['seq_len']} tokens)",
        title_justify="left",
    )
    for col in ("source", "weight", "token share", "docs", "epochs"):
        t.add_column(col, justify="left" if col == "source" else "right")
    for src, s in r["sources"].items():
        t.add_row(
            src,
            f"{s['weight']:.4f}",
            f"{s['token_share']:.4f}",
            f"{s['docs']:,}",
            f"{s['epochs']:.4f}",
        )
    con = wide_console()  # not wrapped at 80 columns when piped
    con.print(t)
    con.print(
        f"padding fraction {r['padding_fraction']:.4f}; documents split "
        f"{r['documents_split']:,}; {r['tokens_per_second']:,.0f} tokens/s "
        f"(backend {r['backend']}, first step after {r['startup_seconds']:.1f} s)",
        highlight=False,
    )


@data.command("at-step")
@click.argument("config_or_run_dir", metavar="CONFIG_OR_RUN_DIR")
@click.argument("step", type=int)
@click.option("--rows", type=click.IntRange(min=1), default=None, help="Show the first N rows.")
@click.option("--decode", is_flag=True, help="Add each row's text (the dataset's tokenizer).")
@json_option
def at_step(
    config_or_run_dir: str, step: int, rows: int | None, decode: bool, as_json: bool
) -> int:
    """The rows training step STEP (as logged: the STEP-th optimizer step) trained
    on: per row its source, document ids, shard file and row, tokens per document
    piece. CONFIG_OR_RUN_DIR: a config (before training) or a run directory (its
    config, and the steps its run skipped: train.skip_steps and P0 rollbacks)."""
    from trainlab.data.at_step import config_of, rows_at_step

    config, run_dir = config_of(config_or_run_dir)
    cfg = load_config(config)
    report = rows_at_step(cfg, step, rows=rows, decode=decode, run_dir=run_dir)
    if as_json:
        echo_json(report)
        return 0
    skipped = " (skipped by its run: never trained on)" if report.get("skipped") else ""
    click.echo(f"step {report['step']}: {len(report['rows'])} rows{skipped}")
    for i, r in enumerate(report["rows"]):
        docs = ", ".join(
            f"{d} ({shard} row {row}, {n} tokens)"
            for d, shard, row, n in zip(
                r["doc_ids"], r["shard"], r["row"], r["tokens"], strict=True
            )
        )
        click.echo(f"[{i}] {r['source']}: {docs}")
        if "text" in r:
            click.echo(r["text"])
    return 0
