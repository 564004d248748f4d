"""Prep throughput: `trainlab prep` end to end (read, clean, dedup, tokenize, write)
on the >= 100 MB variant of the demo corpus, in tokens/s.

Baseline, measured in the same run over the same (kept, cleaned) texts: one
process calling `tokenizers` `encode_batch_fast` (the call prep's actors make,
trainlab.data.prep.units) with its own thread pool, which is the tokenization
limit of this machine, cut in slices run before, between and after three prep
runs (the median run counts). The slower
`encode_batch` (offsets computed too), the headline baseline before, is kept in
the notes on a quarter of the batches. The prep time excludes starting Ray and
training the tokenizer (both reported in notes). Where the time goes: CPU
seconds per stage as measured inside the Ray workers, and the driver's own.

Every prep runs as its own `trainlab prep --json` process (the driver) attached
to this process's Ray cluster, so its peak memory is the driver's alone:

- `prep_driver_bytes_per_token`: bytes of document data (text, token ids) the
  driver received per token prepared (target 0); baseline: the bytes of token
  ids per token, the least a driver that writes the shards itself receives.
- `prep_driver_peak_rss_bytes`: the driver's peak RSS on the full corpus
  against the same on a quarter of it (target: ratio ~1, flat).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from devtools.bench import BenchResult

BENCH_DIR = Path("data/bench")
CORPUS_MB = 110  # code domain cap; with docs and pkgdocs the corpus is ~115 MB
BASELINE_BATCH = 256
PREP_SAMPLES = 3  # full-corpus prep runs; the median counts


def bench_prep() -> list[BenchResult]:
    from tokenizers import Tokenizer

    from devtools.demo_corpus import DEMO_SOURCES, build_demo_corpus
    from trainlab.raycluster import ensure_ray

    ensure_ray()  # up front: its start-up time is not prep's, and a failure shows early
    t = time.perf_counter()
    stats = build_demo_corpus(BENCH_DIR / "raw", max_mb=CORPUS_MB, with_site_packages=True)
    quarter_stats = build_demo_corpus(
        BENCH_DIR / "raw-quarter", max_mb=CORPUS_MB / 4, with_site_packages=True
    )
    build_s = time.perf_counter() - t
    sources = _bench_sources(DEMO_SOURCES, BENCH_DIR)
    quarter_sources = _bench_sources(DEMO_SOURCES, BENCH_DIR, "raw-quarter")
    texts = _kept_texts(sources)
    # The timed run is given a tokenizer trained here the way prep trains one, so it
    # measures read, clean, dedup, tokenize and write only.
    t = time.perf_counter()
    tokenizer = _train_tokenizer(texts, BENCH_DIR / "tokenizer.json")
    train_s = time.perf_counter() - t
    batches = [texts[i : i + BASELINE_BATCH] for i in range(0, len(texts), BASELINE_BATCH)]

    # The machine is shared and drifts: prep runs PREP_SAMPLES times (the median
    # counts), interleaved with the baseline cut in PREP_SAMPLES + 1 slices, so a
    # change in load hits both sides alike.
    load_before = os.getloadavg()[0]
    slices = PREP_SAMPLES + 1
    baseline_s = baseline_cpu_s = 0.0
    baseline_tokens = 0
    baseline_tokenizer = Tokenizer.from_file(str(tokenizer))

    def baseline_slice(k: int) -> None:
        nonlocal baseline_s, baseline_cpu_s, baseline_tokens
        cpu = time.process_time()
        seconds, n = _encode_seconds(baseline_tokenizer, batches[k::slices], fast=True)
        baseline_cpu_s += time.process_time() - cpu
        baseline_s += seconds
        baseline_tokens += n

    baseline_slice(0)
    quarter = _prep_process(quarter_sources, BENCH_DIR / "prepared-quarter", tokenizer)
    runs = []
    for k in range(1, slices):
        t = time.perf_counter()
        run = _prep_process(sources, BENCH_DIR / "prepared", tokenizer)
        run["wall_s"] = time.perf_counter() - t
        phases = run["timings"]
        run["prep_s"] = phases["check"] + phases["tokenize_write"] + phases["finish"]
        runs.append(run)
        baseline_slice(k)
    slow_s, slow_tokens = _encode_seconds(tokenizer, batches[0::4])
    result = sorted(runs, key=lambda r: r["prep_s"])[len(runs) // 2]  # the median run
    wall_s, driver_cpu_s, prep_s = result["wall_s"], result["driver_cpu_s"], result["prep_s"]
    phases = result["timings"]
    tokens = sum(s["tokens"] for s in result["sources"].values())
    quarter_tokens = sum(s["tokens"] for s in quarter["sources"].values())
    assert baseline_tokens == tokens, (baseline_tokens, tokens)
    notes = {
        "corpus_mb": round(sum(s["bytes"] for s in stats.values()) / 2**20, 1),
        "docs_out": len(texts),
        "tokens": tokens,
        "prep_s (read+clean+dedup+tokenize+write; the median run)": round(prep_s, 1),
        "prep_s_samples (interleaved with the baseline's slices)": [
            round(r["prep_s"], 1) for r in runs
        ],
        "ratio_samples": [round(baseline_s / r["prep_s"], 3) for r in runs],
        "prep_wall_s (the prep process; Ray already up, its own connect included)": round(
            wall_s, 1
        ),
        "prep_phases_s": {k: round(v, 2) for k, v in phases.items()},
        "tokenizer_training_s (BPE on a 16 MB sample, not in prep_s)": round(train_s, 1),
        "encode_batch_fast_s (the headline baseline: what prep's actors call)": round(
            baseline_s, 1
        ),
        "encode_batch_tokens_per_s (offsets too; the old headline baseline)": round(
            slow_tokens / slow_s
        ),
        "ratio_vs_encode_batch (old baseline)": round(
            (tokens / prep_s) / (slow_tokens / slow_s), 3
        ),
        # CPU time is what a busy shared machine distorts least: baseline CPU seconds
        # over prep's (workers' read/clean and tokenize, plus this driver process).
        "cpu_s": {
            "read+clean+hash (workers)": round(phases["cpu_read_clean"], 1),
            "tokenize (workers)": round(phases["cpu_tokenize"], 1),
            "dedup keys (workers)": round(phases["cpu_dedup_keys"], 1),
            "driver (whole prep process: imports, Ray client, planning)": round(driver_cpu_s, 1),
            "encode_batch_fast baseline": round(baseline_cpu_s, 1),
        },
        "cpu_ratio (baseline cpu / prep cpu)": round(
            baseline_cpu_s / (phases["cpu_read_clean"] + phases["cpu_tokenize"] + driver_cpu_s), 3
        ),
        "corpus_build_s": round(build_s, 1),
        # The machine is shared: its 1-minute load before the baseline and after the
        # last timed call (2 cores: above ~2.5, others' processes took CPU; prep's
        # workers and the baseline both run at nice 0, but load need not hit both alike).
        "load_avg_1m (before, after)": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    itemsize = 2 if result["tokenizer"]["dtype"] == "uint16" else 4
    driver_notes = {
        "driver_received_bytes_per_token (all: counts, file lists)": round(
            result["driver_received_bytes"] / tokens, 6
        ),
        "units_total": result["units_total"],
    }
    memory_notes = {
        "corpus_mb": {
            "full": round(sum(s["bytes"] for s in stats.values()) / 2**20, 1),
            "quarter": round(sum(s["bytes"] for s in quarter_stats.values()) / 2**20, 1),
        },
        "tokens": {"full": tokens, "quarter": quarter_tokens},
        "target_ratio": "~1.0 (flat within noise)",
    }
    return [
        BenchResult(
            "prep_tokens_per_s",
            tokens / prep_s,
            "tokens/s",
            "encode_batch_fast_tokens_per_s",
            baseline_tokens / baseline_s,
            notes=notes,
        ),
        BenchResult(
            "prep_driver_bytes_per_token",
            result["driver_document_bytes"] / tokens,
            "bytes/token (lower is better; target 0)",
            "token_id_bytes_per_token",
            itemsize,
            notes=driver_notes,
        ),
        BenchResult(
            "prep_driver_peak_rss_bytes",
            result["driver_peak_rss_bytes"],
            "bytes (full corpus)",
            "quarter_corpus_driver_peak_rss_bytes",
            quarter["driver_peak_rss_bytes"],
            notes=memory_notes,
        ),
    ]


def _prep_process(sources: Path, out: Path, tokenizer: Path) -> dict:
    """`trainlab prep --json` from scratch in its own process, attached to this
    process's Ray cluster; its last stdout line (manifest plus run figures)."""
    import ray

    shutil.rmtree(out, ignore_errors=True)
    exe = Path(sys.executable).parent / "trainlab"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    cmd = [str(exe), "prep", str(sources), "--out", str(out), "--tokenizer", str(tokenizer)]
    proc = subprocess.run(
        [*cmd, "--json"], env=env, capture_output=True, text=True, check=False, timeout=3600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"prep failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _bench_sources(demo_sources: Path, bench_dir: Path, raw: str = "raw") -> Path:
    """The demo's sources file, pointed at the bench corpus."""
    spec = yaml.safe_load(demo_sources.read_text())
    spec["root"] = str((bench_dir / raw).resolve())
    path = bench_dir / f"sources-{raw}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _train_tokenizer(texts: list[str], path: Path, sample_mb: float = 16) -> Path:
    from trainlab.data.prep.cleaning import content_id, hash_fraction
    from trainlab.data.prep.spec import DEFAULT_EOS_TOKEN, TokenizerTraining
    from trainlab.data.prep.tokenizer import train_bpe

    fraction = min(1.0, sample_mb * 2**20 / sum(len(t) for t in texts))
    sample = [t for t in texts if hash_fraction(content_id(t) or "0") < fraction]
    path.write_bytes(train_bpe(sample, TokenizerTraining(vocab_size=8192), DEFAULT_EOS_TOKEN))
    return path


def _units(sources: Path, unit_bytes: int = 4 << 20):
    from trainlab.data.prep.pipeline import _check_inputs
    from trainlab.data.prep.units import plan_units

    return plan_units(_check_inputs(sources, None, None).sources, unit_bytes)


def _kept_texts(sources: Path) -> list[str]:
    """The cleaned, deduplicated texts prep tokenized, in order (not timed)."""
    from trainlab.data.prep.units import read_clean_unit

    seen: set[str] = set()
    texts = []
    for unit in _units(sources):
        table = read_clean_unit(unit)
        for doc_id, text in zip(
            table.column("doc_id").to_pylist(), table.column("text").to_pylist(), strict=True
        ):
            if doc_id is not None and doc_id not in seen:
                seen.add(doc_id)
                texts.append(text)
    return texts


def _encode_seconds(
    tokenizer: Path | Any, batches: list[list[str]], fast: bool = False
) -> tuple[float, int]:
    """Seconds for single-process `encode_batch` (`encode_batch_fast` with `fast`: no
    offsets; its own thread pool) over `batches`, with the tokenizer at `tokenizer`
    (a file, or a loaded `tokenizers.Tokenizer` kept across calls, its cache warm as
    prep's workers keep theirs); tokens counted with one EOS per document, as prep
    counts them."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer)) if isinstance(tokenizer, Path) else tokenizer
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    tokens = 0
    t = time.perf_counter()
    for batch in batches:
        tokens += sum(len(e.ids) + 1 for e in encode(batch, add_special_tokens=False))
    return time.perf_counter() - t, tokens


NEAR_DOCS = 1500  # originals of 300+ words from the bench corpus's code
NEAR_COPY_EVERY = 2  # a near-copy of every second one


def bench_near_dedup() -> list[BenchResult]:
    """Near-dup recall on planted near-copies (a few words in a thousand replaced, a
    line appended) at threshold 0.8 on word 5-grams, and the extra loss: what the
    originals lose with the copies present beyond what they lose without them."""
    from devtools.demo_corpus import build_demo_corpus
    from trainlab.data.prep.pipeline import run_prep

    build_demo_corpus(BENCH_DIR / "raw-quarter", max_mb=CORPUS_MB / 4, with_site_packages=True)
    files = sorted((BENCH_DIR / "raw-quarter" / "code").rglob("*.py"))
    texts: list[str] = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if len(text.split()) >= 300 and text not in texts:
            texts.append(text)
        if len(texts) == NEAR_DOCS:
            break
    rng = random.Random(0)
    planted = [_near_copy(t, rng) for t in texts[::NEAR_COPY_EVERY]]
    root = BENCH_DIR / "near"
    shutil.rmtree(root, ignore_errors=True)
    tokenizer = BENCH_DIR / "tokenizer.json"
    if not tokenizer.exists():
        _train_tokenizer(texts, tokenizer)
    t = time.perf_counter()
    base = run_prep(
        _near_corpus(root / "base", texts, []), root / "base-out", tokenizer=str(tokenizer)
    )
    base_s = time.perf_counter() - t
    t = time.perf_counter()
    with_copies = run_prep(
        _near_corpus(root / "planted", texts, planted),
        root / "planted-out",
        tokenizer=str(tokenizer),
    )
    planted_s = time.perf_counter() - t
    found = with_copies.manifest["sources"]["copies"]["rejected"]["near_duplicate"]["count"]
    orig_base = base.manifest["sources"]["orig"]
    orig_planted = with_copies.manifest["sources"]["orig"]
    notes = {
        "target": "ratio (recall) >= 0.95; extra_removed_from_originals == 0",
        "originals": len(texts),
        "planted_copies": len(planted),
        "extra_removed_from_originals": orig_base["docs_out"] - orig_planted["docs_out"],
        "originals_removed_without_copies": orig_base["docs_in"] - orig_base["docs_out"],
        "same_original_shards": orig_base["shards"] == orig_planted["shards"],
        "prep_s": {"without_copies": round(base_s, 1), "with_copies": round(planted_s, 1)},
    }
    shutil.rmtree(root, ignore_errors=True)
    return [
        BenchResult(
            "prep_near_dup_found",
            found,
            "documents",
            "planted_near_copies",
            len(planted),
            notes=notes,
        )
    ]


def _near_copy(text: str, rng: random.Random) -> str:
    """A few words in a thousand replaced, and a line appended."""
    parts = re.split(r"(\s+)", text)
    words = [i for i in range(0, len(parts), 2) if parts[i]]
    for i in rng.sample(words, max(1, len(words) * 3 // 1000)):
        parts[i] = f"changed{rng.randrange(10**6)}"
    return "".join(parts) + "\n# one more line appended to the copy\n"


def _near_corpus(root: Path, texts: list[str], copies: list[str]) -> Path:
    for name, docs in (("orig", texts), ("copies", copies)):
        if docs:
            (root / name).mkdir(parents=True)
            for i, t in enumerate(docs):
                (root / name / f"{i:05d}.txt").write_text(t)
    spec = {
        "dedup": {
            "exact": True,
            "near": {"enabled": True, "threshold": 0.8, "num_perm": 128, "ngram": 5},
        },
        "sources": [{"name": "orig", "paths": ["orig/"], "format": "text"}]
        + ([{"name": "copies", "paths": ["copies/"], "format": "text"}] if copies else []),
    }
    path = root / "sources.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path
