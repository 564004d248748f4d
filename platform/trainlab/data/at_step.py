"""`trainlab data at-step`: which data made up one training step.

The stream is a pure function of the step (trainlab.data.stream), so the rows of
any step can be rebuilt without training: for each row its source, the documents
with a piece in it (their doc_id, the shard file and row holding each, and the
tokens of the piece), and optionally its text through the dataset's tokenizer.

Steps are numbered as the training loop logs them: step s is the s-th optimizer
step, which trained on stream batch s-1 (checkpoint step-s resumes at batch s).
A run directory adds the steps its run did not train on (train.skip_steps and
the windows P0 rollbacks skipped, from run_summary.json).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from trainlab.data.corpus import read_doc_index
from trainlab.data.manifest import Manifest, load_manifest
from trainlab.errors import UserError


def config_of(config_or_run_dir: str) -> tuple[str, Any]:
    """(config file, run or None) for the command's first argument: a local config
    file, or a run (a run directory, or a run in object storage: `s3://.../DATE/NAME`,
    its config.yaml read into this machine's working copy of it); the run is a
    `trainlab.run.location.RunLocation` (trainlab.run.dir.config_or_run)."""
    from trainlab.run.dir import config_or_run

    config, run = config_or_run(config_or_run_dir, "CONFIG_OR_RUN_DIR")
    return str(config), run


def skipped_windows(cfg: Any, run_dir: Any) -> list[tuple[int, int]]:
    """[first, last] step windows not trained on: the config's and, for a run
    (a directory or a run in object storage), its rollbacks' (run_summary.json,
    else the newest committed checkpoint's record)."""
    from trainlab.run.location import RunLocation

    windows = [(int(a), int(b)) for a, b in cfg.train.skip_steps]
    if run_dir is None:
        return windows
    loc = run_dir if isinstance(run_dir, RunLocation) else RunLocation.of(run_dir)
    rollbacks: list[dict[str, Any]] = []
    summary = loc.read_text("run_summary.json")
    if summary is not None:
        rollbacks = json.loads(summary).get("rollbacks") or []
    else:  # a run still going (or killed): its newest committed checkpoint's record
        steps = sorted(n for n in loc.list("checkpoints") if n.startswith("step-"))
        metas = [loc.read_text(f"checkpoints/{n}/checkpoint.json") for n in steps]
        metas = [m for m in metas if m is not None]
        if metas:
            rollbacks = json.loads(metas[-1]).get("rollbacks") or []
    return windows + [(int(r["skipped"][0]), int(r["skipped"][1])) for r in rollbacks]


@lru_cache(maxsize=8)
def _doc_index(root: str, source: str) -> tuple[list[str], list[str], np.ndarray]:
    """(doc_id per document, shard file per shard, first document index per shard + end)."""
    manifest = load_manifest(root)
    ids, _ = read_doc_index(manifest, source)
    shards = manifest.sources[source].shards
    firsts = np.concatenate([[0], np.cumsum([s.rows for s in shards])]).astype(np.int64)
    return ids, [s.file for s in shards], firsts


def _tokenizer(manifest: Manifest) -> Any:
    from tokenizers import Tokenizer

    where = manifest.location
    try:
        data = where.read_bytes("tokenizer.json")
    except FileNotFoundError:
        raise UserError(
            f"{where.uri_of('tokenizer.json')}: missing; --decode needs the dataset's tokenizer"
        ) from None
    return Tokenizer.from_str(data.decode("utf-8"))


def rows_at_step(
    cfg: Any,
    step: int,
    rows: int | None = None,
    decode: bool = False,
    run_dir: Path | None = None,
) -> dict[str, Any]:
    """`{"step", "rows": [{"source", "doc_ids", "shard", "row", "tokens"(, "text")}]}`
    for training step `step` (1-based); "shard", "row" and "tokens" are lists
    parallel to "doc_ids" (a row packs pieces of several documents). A step its
    run skipped also has `"skipped": true` (its rows were never trained on)."""
    from trainlab.data.spec import prepare_run_data
    from trainlab.data.stream import TrainStream

    total = cfg.train.total_steps
    if not 1 <= step <= total:
        raise UserError(f"STEP {step}: must be in 1..train.total_steps ({total})")
    spec = prepare_run_data(cfg, check_checksums=False)
    stream = TrainStream(spec)
    packed = stream.rank_rows(step - 1)
    manifest = load_manifest(spec.path)
    tokenizer = _tokenizer(manifest) if decode else None
    seq_len = spec.seq_len
    n = len(packed.row_source) if rows is None else min(rows, len(packed.row_source))
    out_rows = []
    for i in range(n):
        s = int(packed.row_source[i])
        name = spec.sources[s]
        ids, files, firsts = _doc_index(str(manifest.root), name)
        unit = int(packed.row_unit[i])
        pieces = stream.streams[s].pieces(unit * seq_len, (unit + 1) * seq_len, seq_len)
        shard_of = np.searchsorted(firsts, pieces.doc, side="right") - 1
        row: dict[str, Any] = {
            "source": name,
            "doc_ids": [ids[d] for d in pieces.doc.tolist()],
            "shard": [files[k] for k in shard_of.tolist()],
            "row": (pieces.doc - firsts[shard_of]).tolist(),
            "tokens": pieces.length.tolist(),
        }
        if tokenizer is not None:
            row["text"] = tokenizer.decode(
                packed.batch["input_ids"][i].tolist(), skip_special_tokens=False
            )
        out_rows.append(row)
    result: dict[str, Any] = {"step": step, "rows": out_rows}
    if any(a <= step <= b for a, b in skipped_windows(cfg, run_dir)):
        result["skipped"] = True
    return result
