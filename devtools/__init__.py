"""Developer tooling beside the library, not part of the installed `trainlab` package.

Run from the repository root (so `devtools` is importable):

    python -m devtools.demo      # `make demo`: corpus -> prep -> train the tiny recipe
    python -m devtools.bench     # `make bench`: benchmarks -> bench-results.json
    python devtools/gpu_check.py # `make gpu-check`: the GPU paths on a lent GPU machine

Modules: `bench` (benchmarks, each against a baseline measured in the same run),
`demo` (the `make demo` driver), `demo_corpus` (the demo corpus builder;
data_prep/build_demo_corpus.py is its entry script), `datasets` (small prepared
datasets for tests and benchmarks, written by `trainlab prep`'s own code),
`gpu_check` (one short run that verifies the GPU paths; `--cpu-rehearsal` here).
The library never imports this package.
"""
