"""`trainlab data inspect`: run the loader for N steps without training and report
what it delivered, counted from the rows that came out of the pipeline."""

from __future__ import annotations

import time
from typing import Any

from trainlab.data.loader import Backend, WorkerLoader
from trainlab.data.spec import DataSpec, prepare_run_data


def delivery_report(
    loader: WorkerLoader, tokens_per_second: float, startup_s: float
) -> dict[str, Any]:
    """The inspect JSON from a loader that has delivered some steps."""
    spec: DataSpec = loader.spec
    d = loader.delivery
    total_rows = max(1, sum(d.rows.values()))
    sources = {}
    for i, name in enumerate(spec.sources):
        rows = d.rows.get(name, 0)
        sources[name] = {
            "weight": spec.weights[i],
            "token_share": rows / total_rows,
            "docs": d.doc_starts.get(name, 0),
            "epochs": rows * spec.seq_len / spec.train_tokens[i],
            "tokens": rows * spec.seq_len,
        }
    return {
        "sources": sources,
        "padding_fraction": d.padding_tokens / d.tokens if d.tokens else 0.0,
        "tokens_per_second": tokens_per_second,
        "steps": d.steps,
        "documents_split": d.rows_split,
        "tokens": d.tokens,
        "startup_seconds": startup_s,
        "backend": loader.backend,
        "seq_len": spec.seq_len,
        "global_batch_size": spec.global_batch_size,
        "fingerprint": spec.fingerprint,
        "epochs_needed_for_total_steps": dict(zip(spec.sources, spec.epochs_needed, strict=True)),
    }


def inspect_stream(cfg: Any, steps: int, backend: Backend = "ray_data") -> dict[str, Any]:
    """Check the data for `cfg`, deliver `steps` global batches (as one rank holding
    the whole batch) and report. `tokens_per_second` is measured from the first
    delivered step to the last (pipeline start-up is `startup_seconds`)."""
    spec = prepare_run_data(cfg)
    if backend == "ray_data":
        from trainlab.raycluster import ensure_ray

        ensure_ray(cfg.resource.local_num_cpus)
    loader = WorkerLoader(spec, 0, 1, backend=backend)
    t0 = time.perf_counter()
    first_at, first_tokens = None, 0
    for _step, micro in loader.iter_from(0, steps):
        if first_at is None:
            first_at, first_tokens = time.perf_counter(), sum(m["input_ids"].size for m in micro)
    end = time.perf_counter()
    first_at = first_at or end
    if end > first_at:  # steady state: the steps after the first one
        rate = (loader.delivery.tokens - first_tokens) / (end - first_at)
    else:
        rate = loader.delivery.tokens / max(end - t0, 1e-9)
    return delivery_report(loader, rate, first_at - t0)
