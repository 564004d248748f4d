"""Data preparation (`trainlab prep`): raw sources -> clean -> dedup -> tokenize ->
Parquet shards + manifest.json (docs/contracts.md, contract 2), on Ray Data.

    from trainlab.data.prep import run_prep
    result = run_prep("data_prep/sources/demo.yaml", "data/demo/prepared")

Modules: `spec` (the sources YAML), `paths` (listing files, local or s3/gs),
`readers` (records of one file), `cleaning`, `tokenizer`, `units` (work units;
read, clean, tokenize one), `dedup` (exact and MinHash/LSH near dedup as a
hash-partitioned shuffle), `stages` (what the workers run), `work` (recorded
units, for resuming), `executors` (Ray Data or in-process), `shards`
(accounting, shard writing), `manifest`, `pipeline` (`run_prep`). How it
scales, dedups and resumes: docs/prep.md. The demo corpus builder is
devtools/demo_corpus.py, outside the package.
"""

from trainlab.data.prep.cleaning import REASONS
from trainlab.data.prep.pipeline import PrepResult, run_prep
from trainlab.data.prep.spec import load_sources_file

__all__ = ["REASONS", "PrepResult", "load_sources_file", "run_prep"]
