"""`trainlab export`: a run's checkpoint as a Hugging Face model directory
(trainlab.export; docs/export.md)."""

from __future__ import annotations

import click

from trainlab.cli.common import echo_json, json_option


@click.command()
@click.argument("path", metavar="RUN_DIR_OR_CHECKPOINT", type=click.Path())
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="New (or empty) directory for the model.")
@click.option("--step", type=int, default=None,
              help="Export the checkpoint of this step (default: the newest valid one).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Dtype of the exported weights.")
@click.option("--max-shard-size", default="5GB", show_default=True, metavar="SIZE",
              help="Split the weights into safetensors shards of at most SIZE (e.g. 2GB, 500MiB).")
@click.option("--tokenizer", type=click.Path(dir_okay=False), default=None,
              help="tokenizer.json to ship instead of the run dataset's (when that dataset changed).")
@click.option("--no-mlflow", is_flag=True, help="Do not log the export to the run's MLflow record.")
@json_option
def export(
    path: str,
    out: str,
    step: int | None,
    dtype: str,
    max_shard_size: str,
    tokenizer: str | None,
    no_mlflow: bool,
    as_json: bool,
) -> int:
    """Write a checkpoint as a Hugging Face model directory (config.json, safetensors,
    generation_config.json, tokenizer) that transformers' AutoModelForCausalLM and
    AutoTokenizer load. RUN_DIR_OR_CHECKPOINT is a run directory (its newest valid
    checkpoint) or one checkpoint directory."""
    from trainlab.export.exporter import export_model, parse_size

    result = export_model(
        path,
        out,
        step=step,
        dtype=dtype,
        max_shard_bytes=parse_size(max_shard_size),
        tokenizer=tokenizer,
        track=not no_mlflow,
    )
    if as_json:
        echo_json(result)
        return 0
    click.echo(
        f"exported step {result['step']} of {result['run_dir']} as "
        f"{result['hf_class'] or result['arch']} "
        f"({result['dtype']}, {result['weights_bytes'] / 2**20:.1f} MiB, "
        f"{result['num_tensors']} tensors) to {result['out']} in {result['seconds']:.1f} s"
    )
    click.echo(f"sha256 {result['sha256']}")
    if result["mlflow_run_id"]:
        click.echo(f"logged to MLflow run {result['mlflow_run_id']}")
    elif not no_mlflow:
        click.echo("no MLflow record of this run found; not logged")
    if result["hf_class"]:  # a transformers class; a user architecture wrote its own files
        click.echo(
            f"load it: AutoModelForCausalLM.from_pretrained({result['out']!r}), "
            f"AutoTokenizer.from_pretrained({result['out']!r})"
        )
    else:
        click.echo(f"written by {result['arch']}'s own export; the tokenizer loads with "
                   f"AutoTokenizer.from_pretrained({result['out']!r})")
    return 0
