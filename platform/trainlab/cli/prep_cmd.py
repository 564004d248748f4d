"""`trainlab prep SOURCES.yaml --out DIR [--tokenizer PATH | --vocab-size N] [--json]`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click

from trainlab.cli.common import echo_json, json_option


@click.command()
@click.argument("sources", type=click.Path(dir_okay=False))
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False),
    help="Output directory (manifest.json, tokenizer.json, <source>/part-*.parquet).",
)
@click.option(
    "--tokenizer",
    "tokenizer",
    type=click.Path(dir_okay=False),
    default=None,
    help="A Hugging Face tokenizers JSON file to use as is.",
)
@click.option(
    "--vocab-size",
    "vocab_size",
    type=click.IntRange(min=1),
    default=None,
    help="Train a byte-level BPE of this size on the sources instead.",
)
@json_option
def prep(
    sources: str, out: str, tokenizer: str | None, vocab_size: int | None, as_json: bool
) -> int:
    """Clean, deduplicate and tokenize SOURCES (a sources YAML) into Parquet shards
    plus manifest.json in --out, on Ray Data. A re-run with unchanged inputs does no
    work and says "up to date"; a re-run after a killed run reuses the work units
    it finished. --json prints the manifest plus units_total, units_reused and
    driver_peak_rss_bytes."""
    from trainlab.data.prep import run_prep
    from trainlab.raycluster import command_log, route_ray_output

    route_ray_output(command_log("prep"))  # the terminal keeps trainlab's lines

    def started() -> None:
        click.echo(f"prep: {sources} -> {out} (starting Ray Data; the bars follow)", err=True)

    with _progress_bar() as progress:
        result = run_prep(
            sources,
            out,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            progress=progress,
            on_checked=started,
        )
    if as_json:
        echo_json({**result.manifest, **result.summary()})
    else:
        _print_summary(result)
    return 0


@contextmanager
def _progress_bar() -> Iterator:
    """A progress callback drawing one bar per phase on stderr (stdout stays clean
    for --json)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    labels = {
        "sample": "reading a sample for the tokenizer",
        "tokenize": "read/clean/tokenize (work units)",
    }
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    tasks: dict[str, int] = {}

    def update(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(labels.get(phase, phase), total=total)
        bar.update(tasks[phase], completed=done, total=total)

    with bar:
        yield update


def _print_summary(result) -> None:  # noqa: ANN001 - PrepResult, imported lazily
    from rich.table import Table

    from trainlab.cli.common import wide_console

    con = wide_console()  # not wrapped at 80 columns when piped
    m = result.manifest
    status = (
        "up to date"
        if result.up_to_date
        else f"prepared in {result.seconds:.1f} s ({result.units_reused} of "
        f"{result.units_total} work units reused from an earlier run)"
    )
    con.print(
        f"{result.out_dir}: {status} (fingerprint {m['fingerprint'][:16]}, "
        f"vocab {m['tokenizer']['vocab_size']}, {m['tokenizer']['dtype']})",
        highlight=False,
    )
    t = Table(title_justify="left")
    for col in ("source", "docs in", "docs out", "rejected", "tokens", "shards"):
        t.add_column(col, justify="left" if col in ("source", "rejected") else "right")
    for name, s in m["sources"].items():
        rejected = (
            ", ".join(
                f"{reason} {r['count']:,}" for reason, r in s["rejected"].items() if r["count"]
            )
            or "-"
        )
        t.add_row(
            name,
            f"{s['docs_in']:,}",
            f"{s['docs_out']:,}",
            rejected,
            f"{s['tokens']:,}",
            str(len(s["shards"])),
        )
    con.print(t)
