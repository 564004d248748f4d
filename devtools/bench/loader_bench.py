"""Loader throughput, side by side in one run, on the same tokens:

- `loader_tokens_per_s`: the mix-and-pack loader (WorkerLoader on Ray Data, one
  rank holding the tiny recipe's whole global batch), timed from starting the
  pipeline to the last of STEPS steps, after one warm-up pipeline (Ray Data's
  one-time start-up is reported in the notes); baseline: a plain numpy memmap reader over the same training
  tokens (nanoGPT's get_batch: random offsets, x and y as int64), the practical
  ceiling for reading tokens.
- `loader_headroom_over_tiny_step`: the same loader rate against the tokens/s
  the tiny recipe's training step consumes (one process, fp32, CPU); a ratio
  far above 1 means training does not wait for data.

Data: the demo corpus (data/demo/prepared) when prepared, else a stdlib dataset
written to a temporary directory.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from devtools.bench import BenchResult

RECIPE = "trainers/recipes/tiny.yaml"
STEPS = 6000


def _dataset(tmp: Path) -> tuple[str, str]:
    from trainlab.data.manifest import resolve_dataset_dir
    from trainlab.errors import UserError

    try:
        return str(resolve_dataset_dir("data/demo/prepared")), "demo corpus"
    except UserError:
        from devtools.datasets import write_stdlib_dataset

        write_stdlib_dataset(tmp / "stdlib", code_docs=400, prose_docs=3000, vocab_size=8192)
        return str(tmp / "stdlib"), "stdlib dataset (demo corpus not prepared)"


def _config(path: str, demo: bool) -> Any:
    """The tiny recipe on `path`: its own mix on the demo corpus, else by token count."""
    from trainlab.config import load_config
    from trainlab.data.manifest import repo_root

    recipe = (repo_root() or Path.cwd()) / RECIPE
    return load_config(recipe, [f"data.path={path}"] + ([] if demo else ["data.mix={}"]))


def _loader_rate(spec: Any, steps: int, backend: str) -> tuple[float, float, int]:
    """(tokens/s over `steps` global batches, seconds to the first step, tokens), timed
    from the call that starts the pipeline to the last step."""
    from trainlab.data import WorkerLoader

    loader = WorkerLoader(spec, 0, 1, backend=backend)
    t0 = time.perf_counter()
    it = loader.iter_from(0, steps)
    next(it)
    first = time.perf_counter() - t0
    for _ in it:
        pass
    return loader.delivery.tokens / (time.perf_counter() - t0), first, loader.delivery.tokens


def _memmap_rate(spec: Any, tmp: Path, tokens: int) -> float:
    """nanoGPT's reader over the mixed sources' training tokens, written as one .bin."""
    from trainlab.data import TrainStream

    stream = TrainStream(spec)
    flat = np.concatenate([stream.corpus[n].tokens for n in spec.sources])
    path = tmp / "train.bin"
    flat.astype(np.uint16 if flat.max() < 1 << 16 else np.uint32).tofile(path)
    data = np.memmap(path, dtype=flat.dtype, mode="r")
    rows, seq_len = spec.global_batch_size, spec.seq_len
    rng = np.random.default_rng(0)
    done, t0 = 0, time.perf_counter()
    while done < tokens:
        ix = rng.integers(0, len(data) - seq_len - 1, rows)
        x = np.stack([data[i : i + seq_len].astype(np.int64) for i in ix])
        y = np.stack([data[i + 1 : i + 1 + seq_len].astype(np.int64) for i in ix])
        done += min(x.size, y.size)
    return done / (time.perf_counter() - t0)


def _tiny_step_rate(cfg: Any, spec: Any, steps: int = 8) -> float:
    """Tokens/s one training process consumes on the tiny recipe."""
    import torch

    from trainlab.data import WorkerLoader
    from trainlab.models import build_model
    from trainlab.train.loop.step import loss_sum_and_count, to_tensors

    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    batches = [micro for _, micro in WorkerLoader(spec, 0, 1, backend="local").iter_from(0, steps)]
    device = torch.device("cpu")

    def step(micro: list[dict]) -> None:
        for mb in micro:
            loss, count = loss_sum_and_count(model, to_tensors(mb, device))
            (loss / count.clamp(min=1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(batches[0])  # warm-up
    t0 = time.perf_counter()
    for micro in batches[1:]:
        step(micro)
    tokens = sum(mb["input_ids"].size for micro in batches[1:] for mb in micro)
    return tokens / (time.perf_counter() - t0)


def bench_loader() -> list[BenchResult]:
    from trainlab.data import prepare_run_data
    from trainlab.raycluster import ensure_ray

    with tempfile.TemporaryDirectory(prefix="trainlab-loader-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        path, what = _dataset(tmp)
        cfg = _config(path, demo=what == "demo corpus")
        spec = prepare_run_data(cfg)
        ensure_ray(cfg.resource.local_num_cpus)
        _, cold_start, _ = _loader_rate(spec, 2, "ray_data")  # Ray Data's one-time start-up
        loader, startup, tokens = _loader_rate(spec, STEPS, "ray_data")
        in_process, _, _ = _loader_rate(spec, STEPS, "local")
        memmap = _memmap_rate(spec, tmp, tokens)
        train = _tiny_step_rate(cfg, spec)
    notes = {
        "data": what,
        "steps": STEPS,
        "tokens": tokens,
        "global_batch": spec.global_batch_size,
        "seq_len": spec.seq_len,
        "loader_cpus": spec.loader_cpus,
        "first_step_s": round(startup, 2),
        "first_step_cold_cluster_s": round(cold_start, 2),
        "in_process_pack_tokens_per_s": round(in_process),
        "mix": dict(zip(spec.sources, spec.weights, strict=True)),
    }
    results = [
        BenchResult(
            "loader_tokens_per_s", loader, "tokens/s", "memmap_tokens_per_s", memmap, notes=notes
        )
    ]
    results.append(
        BenchResult(
            "loader_headroom_over_tiny_step",
            loader,
            "tokens/s",
            "tiny_train_step_tokens_per_s",
            train,
            notes={
                "meaning": "loader tokens/s over the tokens/s one "
                "tiny-recipe training process consumes"
            },
        )
    )
    return results
