"""`python -m devtools.bench [NAME-SUBSTRING ...]`: run benchmarks, write bench-results.json."""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

from devtools.bench import BENCHMARKS, BenchResult

USAGE = """usage: python -m devtools.bench [NAME-SUBSTRING ...]

Runs the benchmarks whose name contains one of the substrings (all without any),
prints value vs baseline measured in the same run, and writes bench-results.json.
Benchmarks: {names}"""


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE.format(names=", ".join(b.split(":")[1] for b in BENCHMARKS)))
        return 0
    selected = [b for b in BENCHMARKS if not argv or any(a in b for a in argv)]
    if not selected:
        print(f"no benchmark matches {' '.join(argv)}; see --help", file=sys.stderr)
        return 2
    results: list[BenchResult] = []
    failed = []
    for target in selected:
        module_name, attr = target.split(":")
        print(f"== {attr} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            fn = getattr(importlib.import_module(module_name), attr)
            results.extend(fn())
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            failed.append(f"{attr}: {type(e).__name__}: {e}")
            print(f"   FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        print(f"   {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    out = Path("bench-results.json")
    out.write_text(json.dumps([r.to_json() for r in results], indent=2) + "\n")
    _print_table(results)
    print(f"wrote {out.resolve()}")
    for f in failed:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failed else 0


def _print_table(results: list[BenchResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="trainlab benchmarks (value vs baseline, same run)", title_justify="left")
    for col in ("name", "value", "unit", "baseline", "baseline value", "ratio"):
        t.add_column(col, justify="right" if "value" in col or col == "ratio" else "left")
    for r in results:
        t.add_row(
            r.name,
            f"{r.value:.4g}",
            r.unit,
            r.baseline_name,
            f"{r.baseline_value:.4g}",
            f"{r.ratio:.3f}",
        )
    Console().print(t)
    for r in results:
        for k, v in r.notes.items():
            print(f"  {r.name}.{k}: {v}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
